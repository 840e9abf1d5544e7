"""``cairn-serve``: serve a model repository over the Open Inference Protocol v2.

    cairn-serve --model-repository ./models [--host 127.0.0.1] [--port 8000]

Binds loopback unless ``--host`` says otherwise. SIGTERM or SIGINT stops accepting,
answers the requests in flight (up to ``--drain-timeout`` seconds; a new request on a
kept-alive connection meanwhile gets 503 with ``Connection: close`` for ``--drain-grace``
seconds), then exits 0. Logs
(access log included) are JSON lines on stderr; the line ``serving on http://HOST:PORT``
says when it is ready (useful with ``--port 0``).

Generative models (directories written by ``export_generator``) each get a generation
engine; ``--num-slots``, ``--prefill-batch`` and ``--max-queue`` set its defaults, which a
model's ``config.json`` key ``"generation"`` overrides. Those exported with a tokenizer
also answer OpenAI's ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``
(``cairn-llm serve PATH`` exports a Hugging Face checkpoint and runs this on it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence

from cairn.serving._batcher import BatchingConfig
from cairn.serving._generate import GenerationConfig
from cairn.serving._http import HttpLimits
from cairn.serving._repository import ModelRepository
from cairn.serving._server import Server


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        access = getattr(record, "cairn_access", None)
        if access is not None:
            return json.dumps({"logger": record.name, **access})
        return json.dumps({"time": round(record.created, 6), "level": record.levelname, "logger": record.name, "message": record.getMessage()})


def parser() -> argparse.ArgumentParser:
    """The command-line parser (``cairn-serve --help``)."""
    p = argparse.ArgumentParser(prog="cairn-serve", description="Serve a model repository over the Open Inference Protocol v2 (HTTP), "
                                "and generative models with a tokenizer over OpenAI's API (/v1).")
    p.add_argument("--model-repository", required=True, help="directory of <model>/<version>/ export directories")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port; default 8000)")
    p.add_argument("--token", default=None, help="require 'Authorization: Bearer TOKEN' (default: $CAIRN_SERVE_TOKEN if set)")
    p.add_argument("--max-body-bytes", type=int, default=HttpLimits.max_body_bytes, help="larger bodies answer 413")
    p.add_argument("--header-timeout", type=float, default=HttpLimits.header_timeout, help="seconds to receive a request's headers (408)")
    p.add_argument("--body-timeout", type=float, default=HttpLimits.body_timeout, help="seconds to receive a request's body (408)")
    p.add_argument("--workers", type=int, default=None, help="threads running models (shared by all models)")
    p.add_argument("--max-queue-delay-us", type=float, default=0.0, help="default batching delay in microseconds")
    p.add_argument("--max-queue-size", type=int, default=BatchingConfig.max_queue_size, help="default queue bound per model (503 beyond)")
    p.add_argument("--no-batching", action="store_true", help="run every request alone unless a config.json enables batching")
    gen = p.add_argument_group("generation", "defaults for generative models (a model's config.json \"generation\" key overrides them)")
    gen.add_argument("--num-slots", type=int, default=GenerationConfig.num_slots, help="KV-cache slots: sequences decoded together per step (default %(default)s)")
    gen.add_argument("--prefill-batch", type=int, default=GenerationConfig.prefill_batch, help="prompts prefilled per engine step (default %(default)s)")
    gen.add_argument("--max-queue", type=int, default=GenerationConfig.max_queue, help="waiting generate requests beyond this answer 503 + Retry-After (default %(default)s)")
    gen.add_argument("--max-new-tokens-limit", type=int, default=None, help="cap on a request's max_tokens (400 above it; default: the model's max_length)")
    gen.add_argument("--kv-layout", choices=("contiguous", "paged"), default=GenerationConfig.kv_layout,
                     help="KV cache: a max_length row per slot, or a pool of blocks with prefix caching and chunked prefill "
                          "(the model needs a paged program) (default %(default)s)")
    gen.add_argument("--num-blocks", type=int, default=None, help="paged: KV blocks in the pool (default: the memory of --num-slots rows)")
    gen.add_argument("--prefill-chunk", type=int, default=GenerationConfig.prefill_chunk,
                     help="paged: prompt tokens per request prefilled per engine step (default %(default)s)")
    gen.add_argument("--no-prefix-caching", action="store_true", help="paged: do not share the blocks of common prompt prefixes")
    p.add_argument("--repository-poll-secs", type=float, default=None, help="re-scan the repository this often and load new versions")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to answer in-flight requests on SIGTERM")
    p.add_argument("--drain-grace", type=float, default=HttpLimits.drain_grace,
                   help="seconds kept-alive connections stay open after SIGTERM, answering new requests 503 (default %(default)s)")
    p.add_argument("--log-level", default="INFO", help="logging level (access log lines are INFO)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server until SIGTERM/SIGINT; the process's exit status.

    Args:
      argv: the arguments (default ``sys.argv[1:]``).
    """
    args = parser().parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter())
    root = logging.getLogger("cairn.serving")
    level = root.level
    root.addHandler(handler)
    root.setLevel(args.log_level.upper())
    try:
        return _serve(args)
    finally:  # called in-process (a notebook, a test): leave no handler on a stream that may close
        root.removeHandler(handler)
        root.setLevel(level)


def _serve(args: argparse.Namespace) -> int:
    batching = BatchingConfig(
        enabled=not args.no_batching,
        max_queue_delay=args.max_queue_delay_us / 1e6,
        max_queue_size=args.max_queue_size,
    )
    limits = HttpLimits(
        max_body_bytes=args.max_body_bytes, header_timeout=args.header_timeout, body_timeout=args.body_timeout, drain_grace=args.drain_grace
    )
    try:
        generation = GenerationConfig(
            num_slots=args.num_slots,
            prefill_batch=args.prefill_batch,
            max_queue=args.max_queue,
            max_new_tokens_limit=args.max_new_tokens_limit,
            kv_layout=args.kv_layout,
            num_blocks=args.num_blocks,
            prefill_chunk=args.prefill_chunk,
            enable_prefix_caching=not args.no_prefix_caching,
        )
        repository = ModelRepository(args.model_repository, batching=batching, generation=generation)
    except (FileNotFoundError, ValueError) as e:
        print(f"cairn-serve: {e}", file=sys.stderr)
        return 2
    server = Server(
        repository,
        host=args.host,
        port=args.port,
        token=args.token or os.environ.get("CAIRN_SERVE_TOKEN") or None,
        limits=limits,
        workers=args.workers,
        drain_timeout=args.drain_timeout,
        poll_interval=args.repository_poll_secs,
    )
    try:
        server.run()
    except OSError as e:
        print(f"cairn-serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
