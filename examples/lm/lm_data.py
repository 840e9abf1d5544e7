"""The recipe's data: synthetic shards written once with the cairn.data writers, read back
through a shuffled, packed, batched cairn.data pipeline with worker processes."""

from __future__ import annotations

import glob
import hashlib
import json
import pathlib
from typing import TYPE_CHECKING, Any

import lm_task
import numpy as np

from cairn import data as cdata

if TYPE_CHECKING:
    import lm_config


def _synthetic_dir(cfg: lm_config.Config) -> pathlib.Path:
    d = cfg.data
    key = json.dumps([d.num_train, d.num_eval, d.max_digits, d.num_shards, cfg.run.seed])
    return pathlib.Path(cfg.run.dir) / "data" / hashlib.sha1(key.encode()).hexdigest()[:10]


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
    train = lm_task.make_problems(d.num_train, d.max_digits, cfg.run.seed, held_out=False)
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


class ToExample:
    """Record (bytes or a Parquet row dict) -> tokens, targets and loss weights."""

    def __init__(self, fmt: str, text_column: str, seq_len: int, answer_only: bool) -> None:
        self.fmt, self.text_column, self.seq_len, self.answer_only = fmt, text_column, seq_len, answer_only

    def __call__(self, record: bytes | dict) -> dict:
        text = record[self.text_column] if isinstance(record, dict) else record
        return lm_task.example_from_text(text, self.seq_len, self.answer_only)


def build_pipeline(
    cfg: lm_config.Config, src: Any, fmt: str, process_index: int = 0, process_count: int = 1
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
    ds = ds.map(ToExample(fmt, text_column, d.seq_len, answer_only=(d.source == "synthetic")))
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

