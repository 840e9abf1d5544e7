"""Statistics: summary() tables and graph(), per-stage counts inline, in threads and in workers."""

import pytest

from cairn.data import MapDataset, ReadOptions


def test_summary_and_graph():
    ds = MapDataset.range(100).shuffle(seed=0).map(_triple).to_iter_dataset().batch(10).prefetch(2)
    it = iter(ds)
    list(it)
    text = it.summary()
    lines = text.splitlines()
    assert lines[0].split()[:6] == [
        "stage",
        "out",
        "total_s",
        "self_s",
        "wait_share",
        "buffer_fill",
    ]
    assert lines[2].split()[0] == "prefetch(2)" and lines[2].split()[1] == "10"
    rows = _stage_rows(it)
    # every stage has its own row, the MapDataset ones below to_iter_dataset
    assert list(rows) == [
        "prefetch(2)",
        "batch(10)",
        "to_iter_dataset",
        "map(_triple)",
        "shuffle(seed=0)",
        "range(0, 100, 1)",
    ]
    assert rows["to_iter_dataset"][0] == 100 and rows["shuffle(seed=0)"][0] == 100
    for _count, total, own in rows.values():  # own time never exceeds total time
        assert own <= total + 1e-9
    g = ds.graph().splitlines()
    assert g[:3] == [
        "prefetch(2)",
        "batch(10)",
        "to_iter_dataset(ReadOptions(num_threads=0, prefetch_buffer_size=2, chunk_records=1024))",
    ]
    it.close()


def _triple(x):
    return x * 3


def _even(x):
    return x % 2 == 0


def _stage_rows(it):
    out = {}
    for ln in it.summary().splitlines()[2:]:
        parts = ln.split()
        if parts and not parts[0].startswith(("main", "worker")):
            # the last five columns are numbers; the stage name may contain spaces
            out[" ".join(parts[:-5])] = (int(parts[-5]), float(parts[-4]), float(parts[-3]))
    return out


@pytest.mark.parametrize("how", ["inline", "threads", "workers"])
def test_summary_counts_each_map_stage(how):
    ds = MapDataset.range(600).map(_triple).filter(_even).batch(8)
    if how == "threads":
        root = ds.to_iter_dataset(ReadOptions(num_threads=2))
    else:
        root = ds.to_iter_dataset()
    if how == "workers":
        root = root.mp_prefetch(2)
    it = iter(root)
    out = list(it)
    rows = _stage_rows(it)
    it.close()
    assert sum(len(b) for b in out) == 300
    # a full pass reads every element exactly once, in whichever process or thread
    assert rows["map(_triple)"][0] == 600 and rows["range(0, 600, 1)"][0] == 600
    assert rows["filter(_even)"][0] == 300  # elements that passed
    assert rows["batch(8)"][0] == 75 == len(out)  # batches of 8 indices, Nones dropped
    assert rows["batch(8)"][1] >= rows["filter(_even)"][1] >= rows["map(_triple)"][1]
