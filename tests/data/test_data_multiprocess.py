"""Worker processes: errors, killed workers, shared memory, shutdown, start methods."""

import gc
import os
import signal
import time

import numpy as np
import pytest

from cairn.data import MapDataset, MultiprocessingOptions, ReadOptions, WorkerDiedError

pytestmark = pytest.mark.multiprocess


def _our_shm_names(it):
    return [shm.name.lstrip("/") for shm in it._w.shms]


def _existing(names):
    return [n for n in names if os.path.exists(os.path.join("/dev/shm", n))]


def explode_on_13(x):
    if x == 13:
        raise KeyError(f"user function failed on record {x}")
    return x


@pytest.mark.parametrize("workers", [0, 2])
def test_worker_exception_reaches_caller_with_traceback(workers):
    ds = MapDataset.range(40).map(explode_on_13).to_iter_dataset().mp_prefetch(workers)
    it = iter(ds)
    got = []
    with pytest.raises(KeyError, match="user function failed on record 13") as info:
        for x in it:
            got.append(x)
    # Every element before the failing one arrives; the state points at the failing one.
    assert got == list(range(13))
    assert it.get_state() == {"version": 1, "next_index": 13}
    if workers:
        cause = info.value.__cause__
        assert cause is not None and "explode_on_13" in str(cause) and "Traceback" in str(cause)
        with pytest.raises(RuntimeError, match="earlier error in a worker"):
            next(it)
    else:
        assert "explode_on_13" in "".join(
            __import__("traceback").format_tb(info.value.__traceback__)
        )
    # Skipping the bad element resumes the stream (fresh workers are started).
    it.set_state({"next_index": 14})
    assert list(it) == list(range(14, 40))
    it.close()


class Unpicklable(Exception):
    def __init__(self, a, b):
        super().__init__(a)
        self.lock = __import__("threading").Lock()


def raise_unpicklable(x):
    if x >= 3:  # element 0 is computed by the main process; fail inside a worker
        raise Unpicklable("no pickle for me", 2)
    return x


def test_unpicklable_worker_exception_becomes_runtime_error():
    it = iter(MapDataset.range(5).map(raise_unpicklable).to_iter_dataset().mp_prefetch(1))
    with pytest.raises(RuntimeError, match="Unpicklable: no pickle for me") as info:
        list(it)
    assert "raise_unpicklable" in str(info.value.__cause__)
    it.close()


def slow(x):
    time.sleep(0.01)
    return x


def test_sigkilled_worker_raises_instead_of_hanging():
    it = iter(
        MapDataset.range(10_000)
        .map(slow)
        .to_iter_dataset(ReadOptions(chunk_records=8))
        .mp_prefetch(2)
    )
    next(it)
    os.kill(it.worker_pids[1], signal.SIGKILL)
    with pytest.raises(WorkerDiedError, match="worker 1 of 2 .* killed by SIGKILL"):
        for _ in range(10_000):
            next(it)
    it.close()


def test_sigterm_to_the_process_group_leaves_the_workers_to_the_main_process():
    """Preemption signals the whole process group: the workers ignore SIGTERM (the main
    process's handler decides), so the pipeline keeps producing the same elements."""
    it = iter(MapDataset.range(400).to_iter_dataset(ReadOptions(chunk_records=8)).mp_prefetch(2))
    first = [int(next(it)) for _ in range(10)]
    for pid in it.worker_pids:
        os.kill(pid, signal.SIGTERM)
    time.sleep(0.3)
    assert all(_alive(pid) for pid in it.worker_pids)
    rest = [int(x) for x in it]
    assert first + rest == list(range(400))
    pids = it.worker_pids
    it.close()
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return waited == 0


def test_no_leaked_shared_memory_and_clean_shutdown():
    ds = (
        MapDataset.range(500)
        .map(lambda x: np.full(100, x))
        .batch(10)
        .to_iter_dataset()
        .mp_prefetch(2)
    )
    it = iter(ds)
    next(it)
    pids = it.worker_pids
    names = _our_shm_names(it)
    assert len(names) == 2 and _existing(names) == []  # unlinked as soon as the workers had them
    it.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # Consuming to the end, and dropping an iterator without close(), also clean up.
    assert len(list(ds)) == 50
    it = iter(ds)
    next(it)
    pids = it.worker_pids
    names = _our_shm_names(it)
    del it
    import gc

    gc.collect()
    time.sleep(0.2)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert _existing(names) == []


def test_large_chunks_fall_back_to_the_pipe_and_zero_copy_arrays_are_writable():
    opts = MultiprocessingOptions(num_workers=2, slot_bytes=1024)
    ds = MapDataset.range(64).map(lambda x: np.full(512, x, np.float64)).batch(4).to_iter_dataset()
    ref = [b for b in ds]
    got = list(ds.mp_prefetch(opts))
    assert all(np.array_equal(a, b) for a, b in zip(ref, got)) and len(got) == len(ref)
    small = list(
        MapDataset.range(64).map(lambda x: np.full(3, x)).batch(4).to_iter_dataset().mp_prefetch(2)
    )
    small[0][0, 0] = 99  # arrays coming out of shared memory are ordinary writable arrays


def record_init(worker_index, worker_count):
    os.environ["CAIRN_TEST_WORKER"] = f"{worker_index}/{worker_count}"


def worker_tag(x):
    return os.environ.get("CAIRN_TEST_WORKER", "main")


def test_worker_init_fn_and_spawn_start_method():
    ds = MapDataset.range(12).map(worker_tag).to_iter_dataset(ReadOptions(chunk_records=2))
    tags = list(
        ds.mp_prefetch(
            MultiprocessingOptions(num_workers=2, start_method="spawn"), worker_init_fn=record_init
        )
    )
    # The first element of a start position is computed by the main process.
    assert tags[0] == "main" and set(tags[1:]) == {"0/2", "1/2"}


def test_options_validation():
    with pytest.raises(ValueError, match="num_workers must be an int >= 0"):
        MultiprocessingOptions(num_workers=-1)
    with pytest.raises(ValueError, match="start_method"):
        MultiprocessingOptions(num_workers=1, start_method="thread")
    ds = MapDataset.range(3).to_iter_dataset()
    assert ds.mp_prefetch(0) is ds


def failing_init(worker_index, worker_count):
    if worker_index == 1:
        raise OSError("cannot open the dataset on this worker")


def test_worker_init_error_is_reported():
    it = iter(
        MapDataset.range(100)
        .to_iter_dataset(ReadOptions(chunk_records=2))
        .mp_prefetch(2, worker_init_fn=failing_init)
    )
    with pytest.raises(OSError, match="cannot open the dataset") as info:
        list(it)
    assert "worker_init_fn" in str(info.value.__cause__)
    it.close()


def _shm_listing():
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _new_segments_that_stay(before, grace_s=5.0):
    """Entries of /dev/shm that are new since ``before`` and still there after a grace
    period (other tests running at the same time create segments that go away again; a
    leaked one stays)."""
    deadline = time.monotonic() + grace_s
    while True:
        new = _shm_listing() - before
        if not new or time.monotonic() > deadline:
            return sorted(new)
        time.sleep(0.1)


def _fail_on_40(x):
    if x == 40:
        raise ValueError("bad record 40")
    return np.full(64, x, np.float32)


def _as_array(x):
    return np.full(64, x, np.float32)


@pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (Linux)")
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dev_shm_listing_unchanged_after_every_way_an_iterator_ends(method):
    """List /dev/shm before and after: consumed to the end, closed mid-stream, dropped
    without close(), stopped by an error in a worker, and after a SIGKILLed worker."""
    opts = MultiprocessingOptions(num_workers=2, start_method=method)
    ds = (
        MapDataset.range(400).map(_as_array).batch(8).to_iter_dataset(ReadOptions(chunk_records=16))
    )
    failing = MapDataset.range(400).map(_fail_on_40).to_iter_dataset(ReadOptions(chunk_records=8))
    before = _shm_listing()

    assert len(list(ds.mp_prefetch(opts))) == 50  # to the end
    it = iter(ds.mp_prefetch(opts))
    next(it)
    it.close()  # mid-stream
    it = iter(ds.mp_prefetch(opts))
    next(it)
    del it  # dropped without close()
    gc.collect()
    it = iter(failing.mp_prefetch(opts))
    with pytest.raises(ValueError, match="bad record 40"):
        list(it)
    it.close()
    it = iter(ds.mp_prefetch(opts))
    for _ in range(3):  # the workers are up (spawned ones have attached)
        next(it)
    os.kill(it.worker_pids[0], signal.SIGKILL)
    with pytest.raises(WorkerDiedError):
        for _ in range(100):
            next(it)
    it.close()
    assert _new_segments_that_stay(before) == []


@pytest.mark.parametrize("when", ["next", "set_state"])
def test_worker_killed_after_its_chunks_were_sent_raises_worker_died(when):
    """Regression: a worker killed after it had sent chunks that were still in the pipe
    made the consumer's reply to that worker (freeing the shared-memory slot, or a
    set_state restart) raise BrokenPipeError instead of WorkerDiedError."""
    ds = MapDataset.range(4000).map(_as_array).to_iter_dataset(ReadOptions(chunk_records=16))
    it = iter(ds.mp_prefetch(MultiprocessingOptions(num_workers=2, per_worker_buffer_size=2)))
    next(it)
    time.sleep(0.5)  # both workers have filled their buffers: chunks wait in the pipes
    os.kill(it.worker_pids[0], signal.SIGKILL)
    time.sleep(0.2)
    if when == "set_state":
        it.set_state({"next_index": 100})
    with pytest.raises(WorkerDiedError, match="worker 0 of 2 .* killed by SIGKILL"):
        for _ in range(4000):
            next(it)
    it.close()
