"""``cairn-llm``: export a Hugging Face checkpoint for serving and serve it, in one command.

    cairn-llm serve PATH [--adapter ADAPTER_DIR] [--name N] [--max-length L] [--max-batch-size B]
                         [--quantize int8] [--dtype D] [--cache-dir DIR] [cairn-serve flags ...]

``vllm serve`` style: the checkpoint directory (``config.json``, safetensors, tokenizer
files) is exported with :func:`cairn.llm.export_for_serving` into a cache directory keyed
by a hash of the checkpoint's files and the export options, so the next start with the
same checkpoint and options reuses the export (and JAX's compilation cache beside it,
``<cache-dir>/xla``);
then ``cairn-serve`` serves it (OpenAI and Open Inference Protocol routes). With
``--adapter``, a PEFT LoRA adapter folder (``adapter_config.json`` +
``adapter_model.safetensors``, as ``save_lora`` or peft write it) is loaded onto the base,
merged into its weights (:func:`cairn.llm.merge_lora`) and the merged model is exported; the
adapter's files are part of the cache key. Every flag
this command does not know goes to ``cairn-serve`` (``--port``, ``--token``,
``--num-slots``, ...). This lives in cairn.llm, not cairn.serving: the server never
imports model code.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from cairn.core_array import atomic_rename

_QUANTIZE = ("int8",)
_EXPORT_FORMAT = 2  # 2: cairn.serving.model/2 manifests. Bump when what an export holds changes: old cache entries are not reused


def parser() -> argparse.ArgumentParser:
    """The command-line parser (``cairn-llm --help``)."""
    p = argparse.ArgumentParser(prog="cairn-llm", description="Cairn's LLM tools.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="export a Hugging Face checkpoint directory (cached) and serve it with cairn-serve",
                       description="Export a Hugging Face checkpoint for serving (cached by its hash) and serve it; "
                                   "flags this command does not know go to cairn-serve (see cairn-serve --help).")
    s.add_argument("path", help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files)")
    s.add_argument("--adapter", default=None, metavar="ADAPTER_DIR",
                   help="a PEFT LoRA adapter folder (adapter_config.json, adapter_model.safetensors) to merge into "
                        "the base before exporting")
    s.add_argument("--allow-base-mismatch", action="store_true",
                   help="serve the adapter even though its base_model_name_or_path names another model than PATH")
    s.add_argument("--name", default=None,
                   help="the served model name (default: the adapter's directory name, else the checkpoint's)")
    s.add_argument("--max-length", type=int, default=2048, help="KV-cache positions per sequence (prompt + completion; default %(default)s)")
    s.add_argument("--max-batch-size", type=int, default=16, help="the most sequences decoded together (default %(default)s)")
    s.add_argument("--quantize", choices=_QUANTIZE, default=None, help="quantize the weights (kept quantized in the export)")
    s.add_argument("--dtype", default=None, help="parameter dtype (default: the checkpoint's)")
    s.add_argument("--cache-dir", default=None,
                   help="where exports are kept (default: $CAIRN_CACHE_DIR, else ~/.cache/cairn/serve)")
    return p


def checkpoint_key(path: str | os.PathLike, options: dict) -> str:
    """A hash of the checkpoint directory's files (names and contents) and the export options.

    Args:
      path: the checkpoint directory. options: what else changes the export (JSON-able).

    Raises:
      FileNotFoundError: no ``config.json`` in ``path``.
    """
    root = pathlib.Path(path)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{root}: no config.json (not a Hugging Face checkpoint directory)")
    h = hashlib.sha256(json.dumps({"format": _EXPORT_FORMAT, **options}, sort_keys=True).encode())
    _hash_files(root, h)
    return h.hexdigest()[:32]


def adapter_digest(path: str | os.PathLike) -> str:
    """A hash of a PEFT adapter folder's files (names and contents), for the export cache key.

    Args:
      path: the adapter folder.

    Raises:
      FileNotFoundError: no ``adapter_config.json`` in ``path``.
    """
    root = pathlib.Path(path)
    if not (root / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{root}: no adapter_config.json (not a PEFT adapter folder)")
    return _hash_files(root, hashlib.sha256(b"peft-adapter\0")).hexdigest()[:32]


def _hash_files(root: pathlib.Path, h: Any) -> Any:
    for f in sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")):
        h.update(f.relative_to(root).as_posix().encode() + b"\0")
        with open(f, "rb") as fh:
            h.update(hashlib.file_digest(fh, "sha256").digest())
    return h


def _cache_root(arg: str | None) -> pathlib.Path:
    if arg:
        return pathlib.Path(arg)
    env = os.environ.get("CAIRN_CACHE_DIR")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "cairn" / "serve"


def prepare(args: argparse.Namespace) -> pathlib.Path:
    """The model repository serving ``args.path``: the cached export when there is one, else
    a fresh export (written beside the cache and moved in whole, so a crash leaves none half
    written).

    Raises:
      FileNotFoundError: not a checkpoint directory (or adapter folder). RuntimeError: cairn.llm has no
      ``export_for_serving`` yet. ValueError, UnsupportedModelError, CheckpointError: as
      the loader and the export raise them.
    """
    adapter = getattr(args, "adapter", None)
    name = args.name or pathlib.Path(adapter or args.path).resolve().name
    options = {"name": name, "max_length": args.max_length, "max_batch_size": args.max_batch_size,
               "quantize": args.quantize, "dtype": args.dtype}
    if adapter is not None:
        options["adapter"] = adapter_digest(adapter)
    key = checkpoint_key(args.path, options)
    repo = _cache_root(args.cache_dir) / key
    if (repo / name / "1" / "manifest.json").is_file():
        print(f"cairn-llm: reusing the export in {repo}", file=sys.stderr)
        return repo
    repo.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{key}-", dir=repo.parent))
    try:
        _export(args, name, tmp)
        if repo.exists():  # another start exported the same key meanwhile: keep theirs
            shutil.rmtree(tmp)
        else:
            atomic_rename(tmp, repo)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"cairn-llm: exported {args.path} to {repo}", file=sys.stderr)
    return repo


def _export(args: argparse.Namespace, name: str, repo: pathlib.Path) -> None:
    import cairn.llm as llm

    export = getattr(llm, "export_for_serving", None)
    if export is None:
        raise RuntimeError("this cairn-llm has no export_for_serving; install a version that has it")
    model = llm.from_pretrained(args.path, dtype=args.dtype)
    if getattr(args, "adapter", None) is not None:
        model = _merge_adapter(model, args)
    tokenizer = llm.Tokenizer.from_pretrained(args.path)
    if args.quantize is not None:
        import jax.numpy as jnp

        from cairn import nn, quant

        # the attention and MLP matrices of every layer, stored as QArrays (export keeps them quantized)
        rules = [quant.QuantizationRule(module_path=r"layers/\d+/(attn|mlp)/\w+", weight_qtype=args.quantize)]
        stored = quant.quantize_params(model, quant.PtqProvider(rules), lambda m, x: m(x), jnp.zeros((1, 8), jnp.int32),
                                       pack=True)
        nn.update(model, nn.state(stored))
    export(model, tokenizer, str(repo), name, version=1, max_length=args.max_length, max_batch_size=args.max_batch_size)


def _base_names(path: str) -> set[str]:
    """What a base checkpoint directory may be called: its folder's name and the last part
    of its config's ``_name_or_path`` (lower case)."""
    root = pathlib.Path(path).resolve()
    names = {root.name.lower()}
    try:
        recorded = json.loads((root / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError):
        recorded = None
    if isinstance(recorded, str) and recorded.strip("/"):
        names.add(recorded.rstrip("/").rsplit("/", 1)[-1].lower())
    return names


def _merge_adapter(model: Any, args: argparse.Namespace) -> Any:
    """``model`` with the PEFT adapter of ``args.adapter`` merged into its weights.

    Raises:
      FileNotFoundError: the adapter folder lacks its files. CheckpointError (a ValueError):
        the adapter does not fit the base (each tensor or module named), or its
        ``base_model_name_or_path`` names another model (unless ``--allow-base-mismatch``).
    """
    import cairn.llm as llm

    adapters = llm.load_lora(args.adapter, model)
    wanted = adapters.base_model_name_or_path
    if wanted and not getattr(args, "allow_base_mismatch", False):
        short = wanted.rstrip("/").rsplit("/", 1)[-1].lower()
        names = _base_names(args.path)
        if short not in names:
            raise llm.CheckpointError(
                f"{args.adapter}: the adapter was trained on base_model_name_or_path={wanted!r}, but the base "
                f"{args.path} is called {sorted(names)}; pass the adapter's base, or --allow-base-mismatch if it is "
                "the same model under another name")
    return llm.merge_lora(model, adapters)


def main(argv: Sequence[str] | None = None) -> int:
    """``cairn-llm``; the process's exit status.

    Args:
      argv: the arguments (default ``sys.argv[1:]``).
    """
    args, rest = parser().parse_known_args(argv)
    if "--model-repository" in rest:
        print("cairn-llm serve: the model repository is the export's; do not pass --model-repository", file=sys.stderr)
        return 2
    from cairn.serving._cli import parser as serve_parser

    try:
        serve_parser().parse_args(["--model-repository", ".", *rest])  # unknown cairn-serve flags fail before exporting
    except SystemExit as e:
        return int(e.code or 2)
    try:
        repo = prepare(args)
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        print(f"cairn-llm serve: {e}", file=sys.stderr)
        return 2
    from cairn.serving import enable_compilation_cache
    from cairn.serving._cli import main as serve

    enable_compilation_cache(repo.parent / "xla")  # the engine's shapes compile once per checkpoint, not per start
    return serve(["--model-repository", str(repo), *rest])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
