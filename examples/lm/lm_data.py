"""The recipe's data: synthetic shards written once with the cairn.data writers, read back
through a shuffled, packed, batched cairn.data pipeline with worker processes."""

from __future__ import annotations

import glob
import hashlib
import json
import pathlib
from typing import Any

import lm_config
import lm_task
import numpy as np

from cairn import data as cdata


def _synthetic_dir(cfg: lm_config.Config) -> pathlib.Path:
    d = cfg.data
    key = [d.num_train, d.num_eval, d.max_digits, d.num_shards, cfg.run.seed]
    if d.worksheet_share:  # the earlier runs' directories keep their names
        key.append(d.worksheet_share)
    key = json.dumps(key)
    return pathlib.Path(cfg.run.dir) / "data" / hashlib.sha1(key.encode()).hexdigest()[:10]


def train_texts(cfg: lm_config.Config) -> list[str]:
    """The synthetic training documents: addition problems, ``data.worksheet_share`` of them
    written as worksheets (``lm_task.worksheet``)."""
    d = cfg.data
    texts = lm_task.make_problems(d.num_train, d.max_digits, cfg.run.seed, held_out=False)
    return lm_task.mix_forms(texts, d.worksheet_share, cfg.run.seed) if d.worksheet_share else texts


def prepare_synthetic(cfg: lm_config.Config) -> dict:
    """Generate the addition problems once and write them as ArrayRecord *and* Parquet shards.

    Returns ``{"arrayrecord": [...], "parquet": [...], "eval": [...]}`` shard paths. The shards
    are reused when they already exist for the same data settings (the writers are atomic, so
    a directory that has the ``done`` marker is complete).
    """
    d = cfg.data
    root = _synthetic_dir(cfg)
    marker = root / "done.json"
    if marker.exists():
        return json.loads(marker.read_text())
    root.mkdir(parents=True, exist_ok=True)
    train = train_texts(cfg)
    held = lm_task.make_problems(d.num_eval, d.max_digits, cfg.run.seed, held_out=True)
    out = {
        "arrayrecord": cdata.write_array_record(
            [t.encode() for t in train], root / "train_arrayrecord", num_shards=d.num_shards, overwrite=True
        ),
        "parquet": cdata.write_parquet(
            [{"text": t} for t in train], root / "train_parquet", num_shards=d.num_shards, overwrite=True
        ),
        "eval": cdata.write_parquet([{"text": t} for t in held], root / "eval_parquet", num_shards=1, overwrite=True),
    }
    out = {k: [str(p) for p in v] for k, v in out.items()}
    marker.write_text(json.dumps(out))
    return out


def _expand(patterns) -> list[str]:
    files: list[str] = []
    for p in patterns:
        files += sorted(glob.glob(p))
    return files


def open_source(cfg: lm_config.Config, shards: dict | None) -> tuple[Any, str, list[str]]:
    """The training source and the held-out texts."""
    d = cfg.data
    if d.source == "synthetic":
        fmt = d.train_format
        src = (
            cdata.ArrayRecordDataSource(shards["arrayrecord"]) if fmt == "arrayrecord"
            else cdata.ParquetDataSource(shards["parquet"], columns=["text"])
        )
        eval_src = cdata.ParquetDataSource(shards["eval"], columns=["text"])
        eval_texts = [r["text"] for r in eval_src.__getitems__(list(range(len(eval_src))))]
        return src, fmt, eval_texts
    files = _expand(d.paths)
    if d.source == "parquet":
        src = cdata.ParquetDataSource(files, columns=[d.text_column])
    else:
        src = cdata.ArrayRecordDataSource(files)
    eval_texts: list[str] = []
    if d.eval_paths:
        ev_files = _expand(d.eval_paths)
        if d.source == "parquet":
            ev = cdata.ParquetDataSource(ev_files, columns=[d.text_column])
            eval_texts = [r[d.text_column] for r in ev.__getitems__(list(range(min(len(ev), d.num_eval))))]
        else:
            ev = cdata.ArrayRecordDataSource(ev_files)
            eval_texts = [bytes(r).decode("utf-8", "replace") for r in ev.__getitems__(list(range(min(len(ev), d.num_eval))))]
    return src, d.source, eval_texts


TOKENIZER_CORPUS = 20_000  # records of a user's data the BPE learns from (the synthetic task: all of them)


def tokenizer_corpus(cfg: lm_config.Config, src: Any, fmt: str) -> list[str]:
    """The texts the BPE learns from: the synthetic training documents (`train_texts`), or
    the first records of a user's data."""
    d = cfg.data
    if d.source == "synthetic":
        return train_texts(cfg)
    rows = src.__getitems__(list(range(min(len(src), TOKENIZER_CORPUS))))
    col = d.text_column if fmt == "parquet" else None
    return [r[col] if col else bytes(r).decode("utf-8", "replace") for r in rows]


def run_tokenizer(cfg: lm_config.Config, src: Any, fmt: str, *, save: bool = True) -> tuple[Any, Any]:
    """The run's tokenizer and its codec: ``tokenizer.kind = "bpe"``: the one in
    ``run.dir/tokenizer`` (a resumed run's), else trained on `tokenizer_corpus` and saved
    there (``save``); ``"byte"``: the byte tokenizer."""
    import lm_generate
    import lm_tokenizer

    if cfg.tokenizer.kind == "byte":
        return lm_generate.tokenizer(), lm_task.BYTES
    path = pathlib.Path(cfg.run.dir) / "tokenizer"
    corpus = tokenizer_corpus(cfg, src, fmt)
    if save:
        tok, _ = lm_tokenizer.load_or_train(path, corpus, cfg.tokenizer.vocab_size, lm_config.vocab_size(cfg))
    else:
        tok = lm_tokenizer.train_bpe(corpus, cfg.tokenizer.vocab_size, lm_config.vocab_size(cfg))
    return tok, lm_tokenizer.Codec.of(tok)


class ToExample:
    """Record (bytes or a Parquet row dict) -> tokens, targets and loss weights (``codec``:
    the tokenizer; default bytes)."""

    def __init__(self, fmt: str, text_column: str, seq_len: int, answer_only: bool, codec: Any = None) -> None:
        self.fmt, self.text_column, self.seq_len, self.answer_only = fmt, text_column, seq_len, answer_only
        self.codec = codec

    def __call__(self, record: bytes | dict) -> dict:
        text = record[self.text_column] if isinstance(record, dict) else record
        return lm_task.example_from_text(text, self.seq_len, self.answer_only, self.codec)


def build_pipeline(
    cfg: lm_config.Config, src: Any, fmt: str, process_index: int = 0, process_count: int = 1, codec: Any = None
) -> cdata.IterDataset:
    """source -> shard by process -> shuffle (reshuffled each epoch) -> tokenize (in worker
    processes) -> pack -> batch (in a prefetch thread)."""
    d = cfg.data
    if d.batch_size % process_count:
        raise ValueError(f"data.batch_size {d.batch_size} is not divisible by {process_count} processes")
    ds = cdata.MapDataset.source(src)
    if process_count > 1:
        ds = ds.shard(process_index, process_count, drop_remainder=True)
    ds = ds.shuffle(seed=d.shuffle_seed).repeat(None)
    text_column = d.text_column if d.source != "synthetic" else "text"
    ds = ds.map(ToExample(fmt, text_column, d.seq_len, answer_only=(d.source == "synthetic"), codec=codec))
    it = ds.to_iter_dataset()
    it = cdata.FirstFitPackIterDataset(
        it,
        length_struct={"inputs": d.seq_len, "targets": d.seq_len, "weights": d.seq_len},
        num_packing_bins=8,
        # The input is already shuffled; unshuffled rows keep the published run reproducible.
        shuffle_bins=False,
    )
    it = it.map(_rename_packed)
    it = it.batch(d.batch_size // process_count, drop_remainder=True)
    if d.num_workers > 0:
        it = it.mp_prefetch(cdata.MultiprocessingOptions(num_workers=d.num_workers))
    # pack and batch in a background thread, so the next batch is ready when the step ends
    return it.prefetch(2)


def _rename_packed(row: dict) -> dict:
    return {
        "inputs": row["inputs"],
        "targets": row["targets"],
        "weights": row["weights"].astype(np.float32),
        "segment_ids": row["inputs_segment_ids"],
        "positions": row["inputs_positions"],
    }

