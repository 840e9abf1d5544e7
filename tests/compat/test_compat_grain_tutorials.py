"""Snippets from Grain's own docs, run unmodified except the import line, beside real Grain.

Sources (google/grain, docs/): tutorials/dataset_basic_tutorial.md,
tutorials/data_loader_tutorial.md, data_loader/samplers.md, data_loader/transformations.md.
Each snippet runs twice: with ``import grain`` (real Grain 0.2.18) and with the import
line switched to ``import cairn.data as grain``; outputs are compared element by element.
Where a snippet shuffles, the permutation differs on purpose (cairn.data has its own
shuffle), so the order is compared as a multiset per epoch and everything else exactly.
"""

from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np
import pytest

grain_real = pytest.importorskip("grain")


def _run(snippet: str, real_import: str, ours_import: str) -> tuple[dict, dict]:
    """Exec ``snippet`` with real Grain, then with cairn.data; (namespace, stdout) pairs."""
    out = {}
    for name, line in (("grain", real_import), ("cairn", ours_import)):
        assert real_import in snippet
        code = snippet.replace(real_import, line)
        ns: dict = {}
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exec(compile(code, f"<{name} snippet>", "exec"), ns)
        ns["__stdout__"] = buf.getvalue()
        out[name] = ns
    return out["grain"], out["cairn"]


def _flat(batches) -> list:
    return sorted(int(v) for b in batches for v in np.asarray(b).reshape(-1))


# --- docs/tutorials/dataset_basic_tutorial.md: MapDataset ---
BASIC = '''
import grain
from pprint import pprint

dataset = (
    # You can also use a shortcut grain.MapDataset.range for
    # range-like input.
    grain.MapDataset.source([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    .shuffle(seed=10)  # Shuffles globally.
    .map(lambda x: x+1)  # Maps each element.
    .batch(batch_size=2)  # Batches consecutive elements.
)

pprint(dataset[0])
pprint(list(dataset))

# Note: Inheriting `grain.RandomAccessDataSource` is optional but recommended.
class MySource(grain.sources.RandomAccessDataSource):
  def __init__(self):
    self._data = [0, 1, 2, 3, 4, 5, 6, 7]

  def __getitem__(self, idx):
    return self._data[idx]

  def __len__(self):
    return len(self._data)

source = MySource()

dataset = (
    grain.MapDataset.source(source)
    .shuffle(seed=10)  # Shuffles globally.
    .map(lambda x: x+1)  # Maps each element.
    .batch(batch_size=2)  # Batches consecutive elements.
)

pprint(dataset[0])
pprint(list(dataset))

# Prints the 3rd element of the second epoch.
pprint(dataset[len(dataset)+2])

filtered_dataset = dataset.filter(lambda e: (e[0] + e[1]) % 2 == 0)

pprint(f"Length of this dataset: {len(filtered_dataset)}")
pprint([filtered_dataset[i] for i in range(len(filtered_dataset))])

shard_index = 0
shard_count = 2

sharded_dataset = dataset[shard_index::shard_count]
print(f"Sharded dataset length = {len(sharded_dataset)}")
pprint(sharded_dataset[0])
pprint(sharded_dataset[1])
'''


def test_dataset_basic_tutorial_map_dataset():
    g, c = _run(BASIC, "import grain\n", "import cairn.data as grain\n")
    gd, cd = g["dataset"], c["dataset"]
    assert len(gd) == len(cd) == 4
    assert [np.asarray(b).shape for b in gd] == [np.asarray(b).shape for b in cd]
    assert _flat(list(gd)) == _flat(list(cd)) == list(range(1, 9))
    # Past the end: the next epoch, a permutation of the same records.
    next_g = [gd[len(gd) + i] for i in range(len(gd))]
    next_c = [cd[len(cd) + i] for i in range(len(cd))]
    assert _flat(next_g) == _flat(next_c) == list(range(1, 9))
    assert len(g["filtered_dataset"]) == len(c["filtered_dataset"]) == 4
    for ds in (g["filtered_dataset"], c["filtered_dataset"]):
        kept = [e for e in (ds[i] for i in range(len(ds))) if e is not None]
        assert all((e[0] + e[1]) % 2 == 0 for e in kept)
    assert len(g["sharded_dataset"]) == len(c["sharded_dataset"]) == 2
    lines = [ns["__stdout__"].splitlines() for ns in (g, c)]
    assert all("'Length of this dataset: 4'" in ln for ln in lines)
    assert "Sharded dataset length = 2" in lines[0] and "Sharded dataset length = 2" in lines[1]


# --- docs/tutorials/dataset_basic_tutorial.md: IterDataset / DatasetIterator ---
ITER = '''
import grain
from pprint import pprint

dataset = (
    grain.MapDataset.source([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    .shuffle(seed=10)  # Shuffles globally.
    .map(lambda x: x+1)  # Maps each element.
    .batch(batch_size=2)  # Batches consecutive elements.
)

dataset_iter = iter(dataset)
pprint(isinstance(dataset_iter, grain.DatasetIterator))

pprint(next(dataset_iter))

checkpoint = dataset_iter.get_state()

pprint(next(dataset_iter))

# Recover the iterator to the state after the first produced element.
dataset_iter.set_state(checkpoint)

pprint(next(dataset_iter))  # This should generate the same element as above
'''


def test_dataset_basic_tutorial_iterator_checkpoint():
    g, c = _run(ITER, "import grain\n", "import cairn.data as grain\n")
    for ns in (g, c):
        out = ns["__stdout__"].split("\n", 1)
        assert out[0] == "True"
        elements = out[1].strip().split("\n")
        assert len(elements) == 3 and elements[1] == elements[2]
        assert list(ns["checkpoint"]) and isinstance(ns["checkpoint"], dict)


# --- docs/tutorials/data_loader_tutorial.md: IndexSampler and InMemoryDataSource ---
SAMPLER = '''
import grain.python as grain

# Setting `num_records` to 5 to limit results.
# For full dataset, set to `len(data_source)`.
index_sampler_example = grain.IndexSampler(
    num_records=5,
    num_epochs=2,
    shard_options=grain.ShardOptions(
        shard_index=0, shard_count=1, drop_remainder=True),
    shuffle=True,
    seed=0)

# Iterator is consumed.
for record_metadata in index_sampler_example:
  print(record_metadata)

# Create new iterator.
index_sampler = grain.IndexSampler(
    num_records=5,
    num_epochs=2,
    shard_options=grain.ShardOptions(
        shard_index=0, shard_count=1, drop_remainder=True),
    shuffle=True,
    seed=0)

in_memory_datasource = grain.InMemoryDataSource(range(5))

print(in_memory_datasource)
print(f"First Record Read: {in_memory_datasource[0]}")
'''


def test_data_loader_tutorial_index_sampler():
    g, c = _run(SAMPLER, "import grain.python as grain\n", "import cairn.data as grain\n")
    gm, cm = list(g["index_sampler"]), list(c["index_sampler"])
    assert [m.index for m in gm] == [m.index for m in cm] == list(range(10))
    # Per-record generators are keyed the same way: identical draws.
    assert [m.rng.integers(1 << 62) for m in gm] == [m.rng.integers(1 << 62) for m in cm]
    for epoch in (slice(0, 5), slice(5, 10)):
        assert sorted(m.record_key for m in gm[epoch]) == sorted(m.record_key for m in cm[epoch]) == [0, 1, 2, 3, 4]
    for ns in (g, c):
        lines = ns["__stdout__"].splitlines()
        assert len([ln for ln in lines if ln.startswith("RecordMetadata(index=")]) == 10
        assert lines[-1] == "First Record Read: 0"


# --- docs/data_loader/transformations.md + DataLoader, exact output ---
TRANSFORMS = '''
import grain.python as transforms
from grain.python import FilterTransform

class PlusOne(transforms.MapTransform):

  def map(self, x: int) -> int:
    return x + 1

class RemoveEvenElements(FilterTransform):

  def filter(self, element: int) -> bool:
    return element % 2
'''


@pytest.mark.parametrize("num_records", [10, 7, 13])
def test_transformations_doc_in_a_data_loader(num_records):
    g, c = _run(
        TRANSFORMS,
        "import grain.python as transforms\nfrom grain.python import FilterTransform\n",
        "import cairn.data as transforms\nfrom cairn.data import FilterTransform\n",
    )
    outs = []
    for mod, ns in ((grain_real, g), (pytest.importorskip("cairn.data"), c)):
        loader = mod.DataLoader(
            data_source=list(range(100, 110)),
            sampler=mod.samplers.IndexSampler(
                num_records=num_records, shuffle=False, num_epochs=2,
                shard_options=mod.sharding.NoSharding(), seed=0,
            ),
            operations=[ns["PlusOne"](), ns["RemoveEvenElements"](), mod.transforms.Batch(3)],
            worker_count=0,
        )
        outs.append([np.asarray(b) for b in loader])
    assert len(outs[0]) == len(outs[1])
    for a, b in zip(*outs):
        assert a.dtype == b.dtype and np.array_equal(a, b)


# --- docs/data_loader/transformations.md: FlatMapTransform in FlatMapMapDataset ---
FLAT_MAP = '''
import grain.experimental as transforms

class FlatMapTransformExample(transforms.FlatMapTransform):
  max_fan_out: int

  def flat_map(self, element: int):
    for _ in range(self.max_fan_out):
      yield element
'''


def test_flat_map_doc_example_in_flat_map_map_dataset():
    g, c = _run(FLAT_MAP, "import grain.experimental as transforms\n",
                "import cairn.data.experimental as transforms\n")
    outs = []
    for mod, ns in ((grain_real, g), (pytest.importorskip("cairn.data"), c)):
        t = ns["FlatMapTransformExample"]()
        t.max_fan_out = 3
        ds = mod.experimental.FlatMapMapDataset(mod.MapDataset.range(5).filter(lambda x: x != 2), t)
        outs.append((len(ds), [ds[i] for i in range(len(ds) + 4)], list(ds), list(ds.to_iter_dataset().batch(4))))
    assert outs[0][:3] == outs[1][:3]
    assert [b.tolist() for b in outs[0][3]] == [b.tolist() for b in outs[1][3]]
