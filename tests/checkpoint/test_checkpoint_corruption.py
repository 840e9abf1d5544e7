"""Damaged metadata never reads as wrong values: every file is checksummed, every error
names the file and says the step is corrupt, and listing falls back to intact steps."""

from __future__ import annotations

import json
import logging
import os
import random

import numpy as np
import pytest

import cairn.checkpoint as cc
from cairn.checkpoint import _fs

STEP = 12345
FILES = ["COMMIT", "_STEP.json", "state/_METADATA.json", "state/_REGIONS.process_0.json",
         "data/state.process_0.json"]


class It:
    def __init__(self, position: int = 0) -> None:
        self.position = position

    def get_state(self) -> dict:
        return {"position": self.position, "seed": 3}

    def set_state(self, state: dict) -> None:
        self.position = state["position"]


def _items(step: int) -> dict:
    return {
        "state": {
            "params": {"w": np.arange(12, dtype=np.float32).reshape(3, 4) + step,
                       "b": np.full(4, step, np.int32)},
            "step": step, "lr": 0.001, "name": "run-1",
        },
        "data": It(17 + step),
    }


def _assert_step(got: dict, step: int) -> None:
    ref = _items(step)["state"]
    np.testing.assert_array_equal(got["state"]["params"]["w"], ref["params"]["w"])
    np.testing.assert_array_equal(got["state"]["params"]["b"], ref["params"]["b"])
    assert got["state"]["step"] == step and got["state"]["lr"] == 0.001
    assert got["data"] == {"position": 17 + step, "seed": 3}


@pytest.fixture
def two_steps(tmp_path):
    """Step 1 and step STEP of a manager; tests damage STEP and expect step 1 to stand."""
    mngr = cc.CheckpointManager(tmp_path, cc.CheckpointManagerOptions(enable_async=False))
    mngr.save(1, _items(1), metrics={"lr": 0.001})
    mngr.save(STEP, _items(STEP), metrics={"lr": 0.001})
    return tmp_path


def _expect_corrupt(root, rel: str) -> None:
    """Step STEP is reported corrupt naming ``rel``; step 1 is what latest/restore give."""
    m = cc.CheckpointManager(root)
    assert m.latest_step() == 1
    assert m.all_steps() == [1]
    why = m.corrupt_steps()
    assert list(why) == [STEP] and rel in why[STEP], why
    with pytest.raises(cc.CheckpointCorruptError, match=rf"step {STEP} in .* is corrupt: .*{rel}") as info:
        m.restore(STEP)
    assert info.value.path is None or info.value.path.endswith(rel)
    _assert_step(m.restore(), 1)


def _flip_trials(root, per_file: int | None, seed: int) -> int:
    rnd = random.Random(seed)
    trials = 0
    for rel in FILES:
        path = os.path.join(root, str(STEP), rel)
        with open(path, "rb") as f:
            orig = f.read()
        positions = list(range(len(orig)))
        if per_file is not None and per_file < len(positions):
            positions = sorted(rnd.sample(positions, per_file))
        for pos in positions:
            mask = rnd.choice([0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0xFF, rnd.randrange(1, 256)])
            damaged = bytearray(orig)
            damaged[pos] ^= mask
            with open(path, "wb") as f:
                f.write(damaged)
            try:
                _expect_corrupt(root, rel)
            except BaseException as err:
                raise AssertionError(f"{rel}: byte {pos} ^ {mask:#04x} was not reported corrupt") from err
            trials += 1
        with open(path, "wb") as f:
            f.write(orig)
    _assert_step(cc.CheckpointManager(root).restore(), STEP)  # restored files: intact again
    return trials


def test_flipped_bytes_in_every_metadata_file_raise_corrupt_error_naming_it(two_steps):
    trials = _flip_trials(two_steps, per_file=60, seed=0)
    assert trials == 60 * len(FILES)


@pytest.mark.slow
def test_every_byte_of_every_metadata_file_flipped(two_steps):
    trials = _flip_trials(two_steps, per_file=None, seed=1)
    print(f"byte flips: {trials} trials, all reported corrupt")
    assert trials > 1500


def _edit(root, rel: str, old: str, new: str) -> None:
    path = os.path.join(root, str(STEP), rel)
    with open(path) as f:
        text = f.read()
    head, body = text.split('"body": ', 1)  # edit the content, not the stored checksum
    assert old in body, (old, body[:500])
    with open(path, "w") as f:
        f.write(head + '"body": ' + body.replace(old, new, 1))


EDITS = [  # plausible values that the old format returned silently
    ("_STEP.json", f'"step": {STEP}', f'"step": {STEP - 1}'),
    ("_STEP.json", '"lr": 0.001', '"lr": 0.0005'),
    ("state/_METADATA.json", json.dumps((0.001).hex()), json.dumps((0.0005).hex())),
    ("state/_METADATA.json", f'"value": {STEP}', f'"value": {STEP - 1}'),
    ("state/_METADATA.json", '"dtype": "float32"', '"dtype": "int32"'),
    ("state/_REGIONS.process_0.json", "3", "2"),
    ("data/state.process_0.json", f'"position": {17 + STEP}', f'"position": {16 + STEP}'),
    ("COMMIT", '"format"', '"formatx"'),
]


@pytest.mark.parametrize("rel,old,new", EDITS, ids=[f"{e[0]}:{e[2]}" for e in EDITS])
def test_targeted_value_edits_are_reported_not_returned(two_steps, rel, old, new):
    _edit(two_steps, rel, old, new)
    _expect_corrupt(two_steps, rel)


def test_dtype_edit_with_matching_storage_dtype_is_caught_too(two_steps):
    _edit(two_steps, "state/_METADATA.json", '"storage_dtype": "float32"', '"storage_dtype": "int32"')
    _edit(two_steps, "state/_METADATA.json", '"dtype": "float32"', '"dtype": "int32"')
    _expect_corrupt(two_steps, "state/_METADATA.json")


@pytest.mark.parametrize("rel", FILES)
def test_truncated_file_skips_to_the_newest_intact_step(two_steps, rel, caplog):
    path = os.path.join(two_steps, str(STEP), rel)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with caplog.at_level(logging.WARNING, logger="cairn.checkpoint"):
        _expect_corrupt(two_steps, rel)
    assert any(f"step {STEP}" in r.getMessage() and "corrupt" in r.getMessage() for r in caplog.records)


def test_missing_step_metadata_is_a_corrupt_step(two_steps):
    os.remove(os.path.join(two_steps, str(STEP), "_STEP.json"))
    _expect_corrupt(two_steps, "_STEP.json")


def test_corrupt_array_data_in_the_latest_step_raises_then_is_skipped(tmp_path):
    mngr = cc.CheckpointManager(tmp_path, cc.CheckpointManagerOptions(enable_async=False))
    big = {"w": np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)}
    mngr.save(1, {"m": big})
    mngr.save(2, {"m": {"w": big["w"] + 1}})
    files = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path / "2" / "m" / "d") for f in fs]
    target = max(files, key=os.path.getsize)
    with open(target, "r+b") as f:
        f.seek(os.path.getsize(target) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    m = cc.CheckpointManager(tmp_path)
    assert m.latest_step() == 2  # array data is checked when read, not when listing
    with pytest.raises(cc.ChecksumError, match=r"step 2 in .* is corrupt: .*leaf 'w'"):
        m.restore()  # never silently another step than latest_step() said
    assert m.latest_step() == 1 and m.corrupt_steps().keys() == {2}
    np.testing.assert_array_equal(m.restore()["m"]["w"], big["w"])


def test_saving_a_step_over_its_corrupt_copy_replaces_it(two_steps):
    _edit(two_steps, "_STEP.json", '"lr": 0.001', '"lr": 0.0005')
    m = cc.CheckpointManager(two_steps, cc.CheckpointManagerOptions(enable_async=False))
    assert m.should_save(STEP)  # the newest intact step is 1
    assert m.save(STEP, _items(STEP), metrics={"lr": 0.001})
    assert m.all_steps() == [1, STEP] and m.corrupt_steps() == {}
    _assert_step(m.restore(), STEP)


def test_delete_removes_a_corrupt_step(two_steps):
    os.remove(os.path.join(two_steps, str(STEP), "_STEP.json"))
    m = cc.CheckpointManager(two_steps)
    m.delete(STEP)
    assert sorted(os.listdir(two_steps)) == ["1"] and m.corrupt_steps() == {}


def test_single_directory_restore_and_metadata_report_a_damaged_file(tmp_path):
    cc.save(tmp_path / "c", {"w": np.ones(3, np.float32), "lr": 0.001})
    _flip = tmp_path / "c" / "_METADATA.json"
    data = bytearray(_flip.read_bytes())
    data[len(data) // 2] ^= 0x01
    _flip.write_bytes(bytes(data))
    for fn in (cc.restore, cc.metadata):
        with pytest.raises(cc.CheckpointCorruptError, match=r"_METADATA.json is corrupt: checksum mismatch"):
            fn(tmp_path / "c")


def _to_format_1(root) -> None:
    """Rewrite every JSON file of ``root`` the way format version 1 wrote it (no checksum)."""
    for r, _, fs in os.walk(root):
        for name in fs:
            if not (name.endswith(".json") or name == "COMMIT"):
                continue
            path = os.path.join(r, name)
            obj = _fs.read_json(path)
            if name == "_METADATA.json":
                obj["version"] = 1
            elif name in ("_STEP.json", "COMMIT"):
                obj.pop("version")
            with open(path, "w") as f:
                f.write(json.dumps(obj, indent=1))


def test_format_1_checkpoints_still_restore(two_steps):
    _to_format_1(two_steps)
    m = cc.CheckpointManager(two_steps)
    assert m.all_steps() == [1, STEP]
    _assert_step(m.restore(), STEP)
    # damage that makes a format 1 file unreadable is still reported, naming the file
    path = os.path.join(two_steps, str(STEP), "state", "_METADATA.json")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:-5])
    _expect_corrupt(two_steps, "state/_METADATA.json")


def test_a_format_2_file_stripped_of_its_checksum_is_corrupt(two_steps):
    path = os.path.join(two_steps, str(STEP), "state", "_METADATA.json")
    obj = _fs.read_json(path)
    obj["leaves"]["lr"]["value"] = (0.0005).hex()
    with open(path, "w") as f:
        f.write(json.dumps(obj, indent=1))  # still says version 2
    _expect_corrupt(two_steps, "state/_METADATA.json")


def test_array_metadata_inside_the_database_disagreeing_is_corrupt(two_steps):
    """TensorStore's own zarr.json (inside the OCDBT database, not one of our JSON files) is
    compared with _METADATA.json when the array is opened: a dtype changed there would
    otherwise return the float bits as integers."""
    import tensorstore as ts

    db = os.path.join(two_steps, str(STEP), "state", "d", "process_0")
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{db}/"}).result()
    key = "params/w/zarr.json"
    z = json.loads(kv.read(key).result().value)
    z["data_type"] = "int32"
    kv.write(key, json.dumps(z).encode()).result()
    m = cc.CheckpointManager(two_steps)
    with pytest.raises(cc.CheckpointCorruptError, match=rf"step {STEP} .* corrupt: leaf 'params/w': .* int32 \(3, 4\) but _METADATA.json says float32"):
        m.restore()
    assert m.latest_step() == 1


def test_format_1_metadata_with_a_malformed_entry_is_corrupt_not_a_key_error(two_steps):
    _to_format_1(two_steps)
    path = os.path.join(two_steps, str(STEP), "state", "_METADATA.json")
    with open(path) as f:
        meta = json.load(f)
    del meta["leaves"]["params/w"]["storage_dtype"]  # the issue saw KeyError: 'storage_dtype'
    with open(path, "w") as f:
        json.dump(meta, f, indent=1)
    _expect_corrupt(two_steps, "state/_METADATA.json")
