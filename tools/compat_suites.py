"""Run a peer library's own test files against Cairn, with the peer's imports pointed at Cairn.

    python tools/compat_suites.py grain                     # Grain's default files, from its wheel
    python tools/compat_suites.py optax --files alias_test.py
    python tools/compat_suites.py flax --peer-tests /tmp/flax/tests/nnx --files '*_test.py'
    python tools/compat_suites.py orbax --peer-tests /tmp/orbax/checkpoint/orbax/checkpoint

Each peer's test files run twice with pytest, in the same interpreter and session, from a
temporary copy outside the repository (nothing of the peer is committed here):

1. on the peer itself, to learn which tests pass there, while recording which test touches
   a name of the peer's private modules that has no public counterpart;
2. with every ``<peer>`` module replaced in ``sys.modules`` before the tests import it: a
   public module (``grain``, ``grain.experimental``, ``optax.losses``...) becomes the Cairn
   module of the same role, and a private one (``grain._src.python.dataset.dataset``) becomes
   a stand-in whose names resolve through the peer's public API: a private name that is the
   same object as a public one (``dataset.MapDataset`` is ``grain.MapDataset``) gives Cairn's
   public name; a private name with no public counterpart gives a placeholder that raises
   ``CompatPrivateAccess`` when used.

Orbax (``--peer-tests <clone>/checkpoint/orbax/checkpoint``) needs more of its test set-up
in both runs: the clone's ``conftest.py`` (absl flags), its ``multiprocess_test`` helpers
(left out of the wheel), one ``jax.distributed`` process over 8 CPU devices, and a few
private names its tests only use to ask about that environment (``is_pathways_backend``,
``process_index``...), which answer as Orbax does there and are not counted as private use.
Its ``test_utils`` and test bases run as Orbax's own code with aliased imports. A private
name touched while a test module is collected fails only the tests that use its value.

The rate is Cairn's passes among the tests that pass on the peer and use only public API.
A test uses the peer's private internals, and is counted apart, when

- on the peer run it touches a name of a private peer module that is the same object as
  no public name (traced at run time, "how": "module name" in ``--out``), or fails on
  Cairn with ``CompatPrivateAccess``;
- its source, or that of a helper it calls (its class's methods and bases, ``setUp``,
  module-level functions, in the test file and the peer's test helpers), reads or sets a
  private attribute of a peer object or mocks the peer's private code, or its own code
  (a test base's methods in a helper file too) uses a private-only name of a private
  module (``tools/compat_private.py`` says exactly what counts; "how": "attribute or mock").

Private tests are listed with the names they use (``--out``: ``private_tests``), never
silently dropped. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import faulthandler
import fnmatch
import importlib
import importlib.util
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import types
from typing import Any

# --- peers ---

# files whose tests exercise Grain's public dataset and loader API (the ones a user ports);
# infrastructure-only files (ipc queues, monitoring, profiler, logging) are left to --files
GRAIN_FILES = (
    "_src/python/dataset/dataset_test.py",
    "_src/python/dataset/transformations/slice_test.py",
    "_src/python/dataset/transformations/repeat_test.py",
    "_src/python/dataset/transformations/batch_test.py",
    "_src/python/dataset/transformations/filter_test.py",
    "_src/python/dataset/transformations/map_test.py",
    "_src/python/dataset/transformations/mix_test.py",
    "_src/python/dataset/transformations/shuffle_test.py",
    "_src/python/dataset/transformations/source_test.py",
    "_src/python/dataset/transformations/flatmap_test.py",
    "_src/python/dataset/transformations/interleave_test.py",
    "_src/python/dataset/transformations/limit_test.py",
    "_src/python/dataset/transformations/zip_test.py",
    "_src/python/dataset/transformations/rebatch_test.py",
    "_src/python/dataset/transformations/prefetch_test.py",
    "_src/python/dataset/transformations/packing_test.py",
    "_src/python/data_loader_test.py",
    "_src/python/samplers_test.py",
    "_src/python/data_sources_test.py",
    "_src/python/options_test.py",
    "_src/python/record_test.py",
    "_src/core/sharding_test.py",
    "_src/core/transforms_test.py",
)

# the public v0 API as its users call it: the manager and its options, the args, the
# checkpointers and the standard / pytree / composite / json / array handlers, transforms
ORBAX_FILES = (
    "checkpoint_manager_test.py",
    "checkpoint_manager_options_test.py",
    "checkpoint_args_test.py",
    "checkpoint_utils_test.py",
    "transform_utils_test.py",
    "_src/checkpointers/checkpointer_test.py",
    "_src/checkpointers/async_checkpointer_test.py",
    "_src/handlers/standard_checkpoint_handler_test.py",
    "_src/handlers/pytree_checkpoint_handler_test.py",
    "_src/handlers/composite_checkpoint_handler_test.py",
    "_src/handlers/json_checkpoint_handler_test.py",
    "_src/handlers/array_checkpoint_handler_test.py",
)

PEERS: dict[str, dict[str, Any]] = {
    "grain": {
        "package": "grain",
        "cairn": "cairn.data",
        # public peer modules whose Cairn module is not "<cairn>.<same tail>"
        "modules": {"grain.python": "cairn.data", "grain.python.experimental": "cairn.data.experimental"},
        # the peer's test helpers (test code, not API), loaded from the peer's own files with
        # their peer imports aliased like the tests': a pytest flag, the packing test base
        "support": ("grain._src.core.pytest", "grain._src.python.dataset.transformations.testing_util"),
        "files": GRAIN_FILES,
    },
    "optax": {
        "package": "optax",
        "cairn": "cairn.optim",
        "modules": {},
        "support": (),
        "files": ("_src/alias_test.py", "_src/transform_test.py", "losses/_classification_test.py"),
    },
    "flax": {  # tests are not in the wheel: --peer-tests <clone>/tests/nnx
        "package": "flax",
        "cairn": None,  # `flax` itself has no counterpart; flax.nnx is cairn.nn
        "modules": {"flax.nnx": "cairn.nn", "flax.nnx.compat": "cairn.nn.compat"},
        # Flax's internal modules have no underscore (flax.nnx.graph, .rnglib, ...): the
        # public API is what `flax` and `flax.nnx` export, and `flax.nnx.compat` (the
        # graph-mode defaults, documented as public API); every other module is private
        "public": ["flax", "flax.nnx", "flax.nnx.compat"],
        "support": (),
        "files": (),
    },
    "orbax": {  # tests are not in the wheel: --peer-tests <clone>/checkpoint/orbax/checkpoint
        "package": "orbax",
        "cairn": None,
        # Orbax's public modules that split its top-level names by topic; Cairn keeps them in
        # one namespace (the args in cairn.checkpoint.args)
        "modules": {"orbax.checkpoint": "cairn.checkpoint", "orbax.checkpoint.checkpoint_args": "cairn.checkpoint.args",
                    "orbax.checkpoint.tree": "cairn.checkpoint.utils",
                    **{f"orbax.checkpoint.{m}": "cairn.checkpoint" for m in (
                        "checkpoint_manager", "checkpointers", "handlers", "transform_utils", "options")}},
        # the tests' helper modules (sharded test trees, tree asserts, the test bases that
        # checkpointer_test and standard_checkpoint_handler_test instantiate), not checkpoint
        # API: they run as the peer's own code, their imports aliased
        "support": ("orbax.checkpoint.test_utils", "orbax.checkpoint._src.testing.test_tree_utils",
                    "orbax.checkpoint._src.checkpointers.checkpointer_test_utils",
                    "orbax.checkpoint._src.handlers.standard_checkpoint_handler_test_utils"),
        # helpers the wheel leaves out (named *_test), loaded from the clone in both runs
        "clone_support": ("orbax.checkpoint._src.testing.oss.multiprocess_test",
                          "orbax.checkpoint._src.testing.multiprocess_test"),
        # Orbax's tests run as one jax.distributed process over 8 CPU devices (what its
        # multiprocess_test.main sets up before the tests); both runs get the same
        "setup": "orbax",
        # isinstance(x, <public class Cairn lacks>) answers False (see _MissingTypeMeta)
        "missing_isinstance_false": True,
        # private names used while a test module is collected fail only the tests using them
        "type_subscripts": True,
        # private names the tests call only to ask about the test environment (one process,
        # no Pathways): on Cairn they answer as Orbax does in that environment, and a test
        # using only these is not counted as private
        "environment": {
            "orbax.checkpoint._src.multihost.multihost": {
                "is_pathways_backend": "false", "is_runtime_to_distributed_ids_initialized": "true",
                "initialize_runtime_to_distributed_ids": "none", "process_index": "process_index",
                "process_count": "process_count", "get_jax_distributed_client": "distributed_client",
                "_unique_barrier_key": "identity"},
            "orbax.checkpoint._src.futures.synchronization": {"OperationIdGenerator": "operation_ids"},
        },
        "files": ORBAX_FILES,
    },
}


class _OperationIds:
    """The environment stand-in for Orbax's operation-id counter (one process: never out of step)."""

    @staticmethod
    def get_current_operation_id() -> str:
        return "0"

    @staticmethod
    def next_operation_id() -> str:
        return "0"


def _environment_value(kind: str) -> Any:
    """The stand-in named ``kind`` in a peer's ``environment`` table."""
    import jax

    return {
        "false": lambda *_, **__: False,
        "true": lambda *_, **__: True,
        "none": lambda *_, **__: None,
        "identity": lambda key: key,
        "process_index": jax.process_index,
        "process_count": jax.process_count,
        "distributed_client": lambda: jax._src.distributed.global_state.client,
        "operation_ids": _OperationIds,
    }[kind]


def _setup_orbax() -> None:
    """One jax.distributed process over 8 CPU devices, as Orbax's test main sets up."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    import socket

    import jax

    jax.config.update("jax_platforms", "cpu")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=1, process_id=0)


_SETUPS = {"orbax": _setup_orbax}

PRIVATE_MARK = "CompatPrivateAccess"
_PRIMITIVES = (int, float, str, bytes, bool, type(None), tuple, frozenset)


def _is_public_module(name: str) -> bool:
    return not any(part.startswith("_") for part in name.split("."))


def _is_test_module(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return last.endswith("_test") or last == "conftest"  # test_utils-style helpers stay: their names count as private


# --- step 0: the peer's public names, computed with the peer installed ---


def _walk(package: str) -> list[types.ModuleType]:
    """Every importable non-test module of ``package``, namespace folders included (import
    errors, e.g. optional backends of the peer, are skipped)."""
    root = importlib.import_module(package)
    names = []
    for base in root.__path__:
        for path in sorted(pathlib.Path(base).rglob("*")):
            rel = path.relative_to(base)
            if "__pycache__" in rel.parts or any(p.startswith(".") for p in rel.parts):
                continue
            if path.is_dir():
                names.append(".".join((package, *rel.parts)))
            elif path.suffix == ".py" and path.stem != "__init__":
                names.append(".".join((package, *rel.with_suffix("").parts)))
    mods = [root]
    for name in names:
        if _is_test_module(name):
            continue
        try:
            mods.append(importlib.import_module(name))
        except Exception:  # noqa: BLE001 - optional backends (TF, ...) of the peer
            continue
    return mods


def public_map(package: str, public_modules: list[str] | None = None) -> dict[str, Any]:
    """{"public": [module names], "private": {module: {name: ["module:<m>"] | [public paths]}}}.

    A private module's name maps to the public paths under which the peer exposes the same
    object (an empty list: private only). Primitive values match by name and value.
    """
    mods = _walk(package)

    def is_public(name: str) -> bool:
        return name in public_modules if public_modules is not None else _is_public_module(name)

    public = [m for m in mods if is_public(m.__name__)]
    index: dict[int, list[str]] = {}
    for mod in public:
        for name, obj in list(vars(mod).items()):
            if not name.startswith("_") and not isinstance(obj, types.ModuleType):
                index.setdefault(id(obj), []).append(f"{mod.__name__}.{name}")
    private: dict[str, dict[str, list[str]]] = {}
    for mod in mods:
        if is_public(mod.__name__):
            continue
        table = private[mod.__name__] = {}
        for name, obj in list(vars(mod).items()):
            if name.startswith("__"):
                continue
            if isinstance(obj, types.ModuleType):
                table[name] = [f"module:{obj.__name__}"]
                continue
            paths = index.get(id(obj), [])
            home = getattr(obj, "__module__", None)
            if not paths and isinstance(home, str) and home.split(".")[0] != package.split(".")[0] \
                    and getattr(sys.modules.get(home), getattr(obj, "__qualname__", "?"), None) is obj:
                paths = [f"external:{home}:{obj.__qualname__}"]  # the standard library's, numpy's...
            if isinstance(obj, _PRIMITIVES):
                paths = [p for p in paths if p.rsplit(".", 1)[-1] == name]
            table[name] = sorted(paths, key=lambda p: (p.count("."), p))
    return {"public": sorted(m.__name__ for m in public), "private": private}


# --- the pytest plugin, in both runs ---


class CompatPrivateAccess(AttributeError):
    """A test used a name of the peer's private modules that has no public counterpart."""


class _PrivateMeta(type):
    """Placeholders for private names: any use raises ``CompatPrivateAccess``."""

    def _refuse(cls, *_: Any, **__: Any) -> Any:
        raise CompatPrivateAccess(f"{PRIVATE_MARK}: {cls.__qualname__} is private to the peer (no public counterpart)")

    __call__ = _refuse
    __iter__ = _refuse
    __bool__ = _refuse
    __len__ = _refuse
    __getitem__ = _refuse
    __instancecheck__ = _refuse
    __subclasscheck__ = _refuse

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        cls._refuse()


class _PrivateTypeMeta(_PrivateMeta):
    """A private placeholder for peers whose test modules use private names while they are
    collected (Orbax's: ``step_lib.NameFormat[Metadata]`` in an annotation, a private
    ``Store()`` among a test's parameters). Outside a test a subscript, a call or an
    attribute gives another placeholder, so the module imports and only the tests that
    use the value fail, as private; inside a test any use raises ``CompatPrivateAccess``."""

    def _defer(cls, *_: Any, **__: Any) -> Any:
        if _TRACE["test"] is not None:
            cls._refuse()
        return _placeholder(f"{cls.__qualname__}(...)")

    __call__ = _defer
    __getitem__ = _defer

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if _TRACE["test"] is not None:
            cls._refuse()
        return _placeholder(f"{cls.__qualname__}.{name}")


def _placeholder(qualname: str) -> type:
    if _OPTIONS["type_subscripts"]:
        return _PrivateTypeMeta(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname, "__module__": "compat"})
    return _PrivateMeta(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname, "__module__": "compat"})


class _MissingMeta(_PrivateMeta):
    """Placeholders for public peer names Cairn lacks: any use raises ``AttributeError``
    (a failure of Cairn), so a module that only mentions the name still imports."""

    def _refuse(cls, *_: Any, **__: Any) -> Any:
        raise AttributeError(cls.__doc__)

    __call__ = _refuse
    __iter__ = _refuse
    __bool__ = _refuse
    __len__ = _refuse
    __getitem__ = _refuse
    __instancecheck__ = _refuse
    __subclasscheck__ = _refuse


class _MissingTypeMeta(_MissingMeta):
    """A missing public class, for peers whose test helpers ask ``isinstance(x, Cls)`` of every
    leaf (Orbax's ``test_utils.is_leaf``): no Cairn object is an instance of a class Cairn
    lacks, so the check answers ``False``; any other use still raises ``AttributeError``."""

    def __instancecheck__(cls, _obj: Any) -> bool:
        return False

    def __subclasscheck__(cls, _sub: Any) -> bool:
        return False


_OPTIONS: dict[str, Any] = {"missing_isinstance_false": False, "type_subscripts": False}


def _missing(qualname: str, message: str) -> type:
    meta = _MissingTypeMeta if _OPTIONS["missing_isinstance_false"] else _MissingMeta
    return meta(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname, "__doc__": message, "__module__": "compat"})


class _Missing(types.ModuleType):
    """A public peer module Cairn has no counterpart for: every name is missing."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"Cairn has no counterpart of the public module {self.__name__} (asked for {name!r})")


class _Alias(types.ModuleType):
    """A public peer module: its names are the Cairn module's (submodules are set on it)."""

    _target: types.ModuleType

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(object.__getattribute__(self, "_target"), name)


class _PrivateShim(types.ModuleType):
    """A private peer module: names resolve through the peer's public API into Cairn."""

    _table: dict[str, list[str]]
    _environment: dict[str, str]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        kind = object.__getattribute__(self, "_environment").get(name)
        if kind is not None:
            return _environment_value(kind)
        table = object.__getattribute__(self, "_table")
        if name not in table:
            raise AttributeError(f"the peer's {self.__name__} has no name {name!r} either")
        paths = table[name]
        if paths and paths[0].startswith("module:"):
            return importlib.import_module(paths[0][len("module:"):])
        if paths and paths[0].startswith("external:"):
            home, qualname = paths[0][len("external:"):].split(":")
            return getattr(importlib.import_module(home), qualname)
        if not paths:
            value: Any = _placeholder(f"{self.__name__}.{name}")
            setattr(self, name, value)
            return value
        for path in paths:
            mod_name, attr = path.rsplit(".", 1)
            mod = sys.modules.get(mod_name)
            if mod is not None and not isinstance(mod, _Missing) and hasattr(mod, attr):
                return getattr(mod, attr)
        return _missing(f"{self.__name__}.{name}", f"Cairn has no counterpart of the peer's public {' / '.join(paths)}")


class _Refuse:
    """Meta path finder: a peer module not registered by ``install_aliases`` is not found."""

    def __init__(self, package: str) -> None:
        self.package = package

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname == self.package or fullname.startswith(self.package + "."):
            raise ModuleNotFoundError(f"{fullname}: not a module of the peer (no alias)", name=fullname)
        return None


def _cairn_module(peer: dict[str, Any], name: str) -> types.ModuleType:
    """The Cairn module standing for the public peer module ``name`` (or a ``_Missing``)."""
    target = peer["modules"].get(name)
    if target is None:
        for prefix, cairn in sorted(peer["modules"].items(), key=lambda kv: -len(kv[0])):
            if name.startswith(prefix + "."):
                target = cairn + name[len(prefix):]
                break
    if target is None and peer["cairn"]:
        target = peer["cairn"] + name[len(peer["package"]):]
    if target is not None:
        try:
            return importlib.import_module(target)
        except ImportError:
            pass
    return _Missing(name)


def install_aliases(config: dict[str, Any]) -> None:
    """Point every module of the peer at Cairn in ``sys.modules`` (see the module docstring)."""
    if _INSTALLED:
        return
    _INSTALLED.append(True)
    peer, table = PEERS[config["peer"]], config["map"]
    _OPTIONS["missing_isinstance_false"] = bool(peer.get("missing_isinstance_false"))
    _OPTIONS["type_subscripts"] = bool(peer.get("type_subscripts"))
    peer = {**peer, "modules": {**peer["modules"], **config.get("extra_modules", {})}}
    for name in table["public"]:
        target = _cairn_module(peer, name)
        if not isinstance(target, _Missing):
            alias = _Alias(name, target.__doc__)
            alias._target, alias.__path__ = target, []
            target = alias
        sys.modules[name] = target
    for name, names in table["private"].items():
        mod = _PrivateShim(name)
        mod._table = names
        mod._environment = peer.get("environment", {}).get(name, {})
        mod.__path__ = []  # a package, so that submodule imports reach sys.modules
        sys.modules[name] = mod
    for name in [*table["public"], *table["private"]]:
        parent, _, child = name.rpartition(".")
        if parent in sys.modules and child not in vars(sys.modules[parent]):
            setattr(sys.modules[parent], child, sys.modules[name])
    sys.meta_path.insert(0, _Refuse(peer["package"]))
    for name in config["support_files"]:  # last: their own peer imports resolve through the aliases
        spec = importlib.util.spec_from_file_location(name, config["support_files"][name])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        try:
            spec.loader.exec_module(mod)
        except AttributeError as err:  # a public name Cairn lacks, used at the helper's top level:
            # the helper keeps what it defined before it; tests needing the rest fail on Cairn
            print(f"compat_suites: helper {name} stopped at import: {err}", file=sys.stderr)
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, mod)


_INSTALLED: list[bool] = []


class _Tracer(types.ModuleType):
    """On the peer run: records which test touches a private-only name of a private module
    (names of the peer's ``environment`` table are not counted)."""

    def __getattribute__(self, name: str) -> Any:
        value = super().__getattribute__(name)
        if not name.startswith("__") and _TRACE["test"] is not None:
            caller = sys._getframe(1).f_code.co_filename
            if caller.endswith("_test.py") and _TRACE["private"].get(self.__name__, {}).get(name) == [] \
                    and name not in _TRACE["environment"].get(self.__name__, {}):
                _TRACE["touched"].setdefault(_TRACE["test"], set()).add(f"{self.__name__}.{name}")
        return value


_TRACE: dict[str, Any] = {"test": None, "private": {}, "touched": {}, "environment": {}}


def _error_line(text: str) -> str:
    """The exception line of a pytest failure report (its last ``E   `` line)."""
    lines = [ln for ln in text.splitlines() if ln.startswith("E  ")] or text.strip().splitlines() or [""]
    return lines[-1][:300]


class Recorder:
    """The pytest plugin: one JSON line per test (and per collection error) appended to the
    events file as it happens, a per-test time limit, and tracing (peer run)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.events = open(config["events"], "a", encoding="utf-8")
        self.current: dict[str, Any] = {}
        _TRACE["private"] = config["map"]["private"]
        _TRACE["environment"] = PEERS[config["peer"]].get("environment", {})

    def _emit(self, event: dict[str, Any]) -> None:
        self.events.write(json.dumps(event) + "\n")
        self.events.flush()

    def pytest_collection_modifyitems(self, items: list[Any]) -> None:
        skip = set(self.config.get("skip", ()))
        items[:] = [it for it in items if it.nodeid not in skip]

    def pytest_collection_finish(self, session: Any) -> None:
        if self.config["mode"] != "peer":
            return
        for name in self.config["map"]["private"]:
            mod = sys.modules.get(name)
            if isinstance(mod, types.ModuleType) and type(mod) is types.ModuleType:
                mod.__class__ = _Tracer

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self._emit({"collect_error": str(report.nodeid).split("::")[0], "text": str(report.longrepr)[-3000:]})

    def _alarm(self, *_: Any) -> None:
        raise TimeoutError(f"compat_suites: test ran past {self.config['timeout']} s")

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        _TRACE["test"] = nodeid
        self.current = {"test": nodeid, "outcome": "passed", "private": False}
        self._emit({"start": nodeid})
        if hasattr(signal, "SIGALRM"):
            signal.signal(signal.SIGALRM, self._alarm)
            signal.alarm(int(self.config["timeout"]))
        # a test stuck where the alarm cannot reach it (a C call, a lock in a thread) ends
        # the process; the driver records it as hung and runs the file on without it
        faulthandler.dump_traceback_later(int(self.config["timeout"]) + 30, exit=True)

    def pytest_runtest_logreport(self, report: Any) -> None:
        entry = self.current
        if report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"
        elif report.failed:
            entry["outcome"] = "failed"
            text = str(report.longrepr)
            entry["private"] = entry["private"] or PRIVATE_MARK in text
            entry["error"] = _error_line(text)

    def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> None:
        if hasattr(signal, "SIGALRM"):
            signal.alarm(0)
        faulthandler.cancel_dump_traceback_later()
        touched = _TRACE["touched"].pop(nodeid, None)
        if touched:
            self.current["touched"] = sorted(touched)
        self._emit(self.current)
        _TRACE["test"] = None


class _CloneFinder:
    """Meta path finder for the peer's test helpers that its wheel leaves out (from the clone)."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname in self.files:
            return importlib.util.spec_from_file_location(fullname, self.files[fullname])
        return None


def pytest_configure(config: Any) -> None:
    """Entry point when this file is loaded as a pytest plugin (``-p compat_suites``)."""
    settings = json.loads(pathlib.Path(os.environ["CAIRN_COMPAT_CONFIG"]).read_text())
    setup = PEERS[settings["peer"]].get("setup")
    if setup:
        _SETUPS[setup]()
    if settings["mode"] == "cairn":
        install_aliases(settings)
    if settings.get("clone_files"):
        sys.meta_path.insert(0, _CloneFinder(settings["clone_files"]))
    config.pluginmanager.register(Recorder(settings), "compat_recorder")


# --- the driver ---


def _peer_dir(package: str, python: str) -> pathlib.Path:
    code = f"import {package}; print(list({package}.__path__)[0])"  # namespace packages too (orbax)
    return pathlib.Path(subprocess.check_output([python, "-c", code], text=True).strip())


def _choose_files(root: pathlib.Path, patterns: list[str]) -> list[pathlib.Path]:
    files = sorted(p for p in root.rglob("*_test.py"))
    rel = {p: str(p.relative_to(root)) for p in files}
    # a pattern matching some path under the root is taken as a path (Orbax's top-level
    # checkpoint_manager_test.py, not experimental/emergency/checkpoint_manager_test.py);
    # otherwise it matches file names anywhere
    by_path = {pat for pat in patterns if any(fnmatch.fnmatch(r, pat) for r in rel.values())}
    chosen = [p for p in files if any(fnmatch.fnmatch(rel[p], pat) if pat in by_path
                                      else fnmatch.fnmatch(p.name, pat) for pat in patterns)]
    if not chosen:
        raise SystemExit(f"compat_suites: no test file under {root} matches {patterns}")
    return chosen


def _run_file(args: argparse.Namespace, work: pathlib.Path, mode: str, name: str,
              settings: dict[str, Any]) -> dict[str, Any]:
    """Run one copied test file in ``mode`` ("peer" or "cairn"); a test that hangs is recorded
    as failed and the file is run again without it (and without the tests already done)."""
    stem = f"{mode}_{pathlib.Path(name).stem}"
    events = work / f"events_{stem}.jsonl"
    results: dict[str, dict[str, Any]] = {}
    collect_errors: dict[str, str] = {}
    log = []
    for _attempt in range(args.max_hangs + 1):
        config = {**settings, "mode": mode, "events": str(events), "skip": sorted(results)}
        (work / f"config_{stem}.json").write_text(json.dumps(config))
        # sitecustomize re-installs the aliases in spawned / forkserver worker processes
        # absl's test temporary directories, apart for each run (else the peer's leftovers
        # under /tmp/absl_testing collide with the Cairn run's)
        (work / f"tmp_{stem}").mkdir(exist_ok=True)
        env = {**os.environ, "CAIRN_COMPAT_CONFIG": str(work / f"config_{stem}.json"),
               "TEST_TMPDIR": str(work / f"tmp_{stem}"),
               "PYTHONPATH": os.pathsep.join([str(work / "plugin"), os.environ.get("PYTHONPATH", "")])}
        cmd = [args.python, "-m", "pytest", "-p", "compat_suites", "-p", "no:cacheprovider", "-q",
               "--no-header", "-rN", "-o", "addopts=", "--rootdir", str(work / "tests"), name]
        events.unlink(missing_ok=True)
        try:
            proc = subprocess.run(cmd, cwd=work / "tests", env=env, capture_output=True, text=True,
                                  timeout=args.file_timeout)
            log.append(proc.stdout + proc.stderr)
        except subprocess.TimeoutExpired:
            log.append(f"file timed out after {args.file_timeout} s")
        started = None
        for line in events.read_text().splitlines() if events.exists() else []:
            event = json.loads(line)
            if "collect_error" in event:
                collect_errors[event["collect_error"]] = event["text"]
            elif "start" in event:
                started = event["start"]
            else:
                results[event["test"]] = event
                started = None
        if started is None:
            break
        results[started] = {"test": started, "outcome": "failed", "private": False,
                            "error": f"hung: killed after {args.test_timeout} s"}
    (work / f"pytest_{stem}.log").write_text("\n".join(log))
    return {"results": results, "collect_errors": collect_errors}


def _read_results(work: pathlib.Path, mode: str) -> dict[str, Any]:
    """The results of an earlier run in ``work`` (its events files), as ``_run_pytest`` returns."""
    merged: dict[str, Any] = {"results": {}, "collect_errors": {}}
    for events in sorted(work.glob(f"events_{mode}_*.jsonl")):
        for line in events.read_text().splitlines():
            event = json.loads(line)
            if "collect_error" in event:
                merged["collect_errors"][event["collect_error"]] = event["text"]
            elif "test" in event:
                merged["results"][event["test"]] = event
    return merged


def _retally(args: argparse.Namespace) -> tuple[list[str], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The files, settings and both runs' results of a finished ``--workdir`` (nothing runs)."""
    work = pathlib.Path(args.retally)
    names = sorted(p.name for p in (work / "tests").glob("*.py") if p.name != "conftest.py")
    config = json.loads(next(work.glob("config_*.json")).read_text())
    if config["peer"] != args.peer:
        raise SystemExit(f"compat_suites: {work} holds a run of {config['peer']}, not {args.peer}")
    peer = json.loads((work / "peer_results.json").read_text())
    return names, config, peer, _read_results(work, "cairn")


def _run_pytest(args: argparse.Namespace, work: pathlib.Path, mode: str, files: list[str],
                settings: dict[str, Any]) -> dict[str, Any]:
    """Every file in ``mode``, ``--jobs`` at a time; the merged results."""
    print(f"[{args.peer}] {mode} run: {len(files)} files", file=sys.stderr, flush=True)
    merged: dict[str, Any] = {"results": {}, "collect_errors": {}}
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for part in pool.map(lambda n: _run_file(args, work, mode, n, settings), files):
            merged["results"].update(part["results"])
            merged["collect_errors"].update(part["collect_errors"])
    return merged


def _prepare(args: argparse.Namespace, work: pathlib.Path) -> tuple[list[str], dict[str, Any]]:
    """Copy the chosen test files under ``work`` and write the plugin; the pytest arguments."""
    peer = PEERS[args.peer]
    root = pathlib.Path(args.peer_tests) if args.peer_tests else _peer_dir(peer["package"], args.python)
    files = _choose_files(root, args.files or list(peer["files"]))
    (work / "tests").mkdir(parents=True)
    (work / "plugin").mkdir()
    shutil.copy(__file__, work / "plugin" / "compat_suites.py")
    (work / "plugin" / "sitecustomize.py").write_text(
        "import json, os, pathlib, sys\n"
        "_c = os.environ.get('CAIRN_COMPAT_CONFIG')\n"
        "if _c:\n"
        "    _s = json.loads(pathlib.Path(_c).read_text())\n"
        "    if _s['mode'] == 'cairn':\n"
        "        import compat_suites\n"
        "        compat_suites.install_aliases(_s)\n"
    )
    if (root / "conftest.py").exists():  # the peer's own pytest set-up (Orbax: absl flags parsed)
        shutil.copy(root / "conftest.py", work / "tests" / "conftest.py")
    names = []
    for path in files:
        flat = "__".join(path.relative_to(root).with_suffix("").parts) + ".py"
        shutil.copy(path, work / "tests" / flat)
        names.append(flat)
    out = work / "map.json"
    code = (f"import json, sys; sys.path.insert(0, {str(work / 'plugin')!r}); import compat_suites; "
            f"open({str(out)!r}, 'w').write(json.dumps(compat_suites.public_map({peer['package']!r}, "
            f"{peer.get('public')!r})))")
    subprocess.run([args.python, "-c", code], check=True, cwd=work, capture_output=True)
    pkg_dir = _peer_dir(peer["package"], args.python)
    modules = [*peer["support"], *args.support]
    support = {m: str(pkg_dir.joinpath(*m.split(".")[1:]).with_suffix(".py")) for m in modules}
    extra = dict(kv.split("=", 1) for kv in args.map)
    # the tests root of a clone is the peer's package folder (orbax/checkpoint)
    clone = {m: str(root.joinpath(*m.split(".")[2:]).with_suffix(".py")) for m in peer.get("clone_support", ())}
    settings = {"peer": args.peer, "map": json.loads(out.read_text()), "support_files": support,
                "clone_files": clone,
                "extra_modules": extra, "timeout": args.test_timeout}
    return names, settings


def _tally(names: list[str], peer: dict[str, Any], cairn: dict[str, Any],
           static: dict[str, list[str]]) -> dict[str, Any]:
    """Per-file and total counts: passed on the peer, private, public, passed on Cairn
    (``static``: the tests ``compat_private`` finds reaching into the peer's internals)."""
    files: dict[str, dict[str, int]] = {n: {"peer_passed": 0, "private": 0, "public": 0, "cairn_passed": 0}
                                        for n in names}
    private_tests, failures = [], []
    for test, res in sorted(peer["results"].items()):
        if res["outcome"] != "passed" or test.split("::")[0] not in files:
            continue
        f = files[test.split("::")[0]]
        f["peer_passed"] += 1
        ours = cairn["results"].get(test)
        collect_error = cairn["collect_errors"].get(test.split("::")[0], "")
        touched = res.get("touched") or []
        if touched or (ours and ours["private"]) or PRIVATE_MARK in collect_error:
            f["private"] += 1
            private_tests.append({"test": test, "how": "module name",
                                  "names": touched or [(ours or {}).get("error", "import")]})
            continue
        if static.get(test):  # a private attribute or a mock of private code (compat_private)
            f["private"] += 1
            private_tests.append({"test": test, "how": "attribute or mock", "names": static[test],
                                  "cairn": (ours or {}).get("outcome", "not run")})
            continue
        f["public"] += 1
        if ours and ours["outcome"] == "passed":
            f["cairn_passed"] += 1
        else:
            why = (ours or {}).get("error") or (_error_line(collect_error) if collect_error else "not run")
            failures.append({"test": test, "error": why})
    return {"files": files, "private_tests": private_tests, "failures": failures}


def _static_private(args: argparse.Namespace, work: pathlib.Path, names: list[str],
                    settings: dict[str, Any], peer: dict[str, Any]) -> dict[str, list[str]]:
    """The tests passing on the peer that read or set the peer's private attributes or mock its
    private code, found in their source (see ``tools/compat_private.py``)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import compat_private

    package = PEERS[args.peer]["package"]
    if args.no_static:
        return {}
    helpers = {m: pathlib.Path(p) for m, p in {**settings["support_files"], **settings.get("clone_files", {})}.items()}
    passed = [t for t, r in peer["results"].items() if r["outcome"] == "passed"]
    return compat_private.analyze(package, settings["map"]["private"], _peer_dir(package, args.python),
                                  {n: work / "tests" / n for n in names}, helpers, passed,
                                  PEERS[args.peer].get("environment", {}))


def _rate(passed: int, public: int) -> float:
    return round(passed / public, 4) if public else 0.0


def _print(args: argparse.Namespace, tally: dict[str, Any]) -> dict[str, Any]:
    width = max(len(n) for n in tally["files"])
    print(f"{'file':<{width}}  peer_pass  private  public  cairn_pass  rate")
    total = {"peer_passed": 0, "private": 0, "public": 0, "cairn_passed": 0}
    for name, f in tally["files"].items():
        print(f"{name:<{width}}  {f['peer_passed']:9d}  {f['private']:7d}  {f['public']:6d}  "
              f"{f['cairn_passed']:10d}  {_rate(f['cairn_passed'], f['public']):.1%}")
        for k in total:
            total[k] += f[k]
    print(f"{'total':<{width}}  {total['peer_passed']:9d}  {total['private']:7d}  {total['public']:6d}  "
          f"{total['cairn_passed']:10d}  {_rate(total['cairn_passed'], total['public']):.1%}")
    counts: dict[str, int] = {}
    for t in tally["private_tests"]:
        for n in {n.split(" in ")[0] for n in t["names"]}:
            counts[n] = counts.get(n, 0) + 1
    static = sum(t["how"] == "attribute or mock" for t in tally["private_tests"])
    print(f"\nprivate-internals tests: {total['private']}, {static} of them by a private attribute or a mock "
          "of private code (by the private name they use; full list with --out)")
    for name, n in sorted(counts.items(), key=lambda kv: -kv[1])[: args.show]:
        print(f"  {n:6d}  {name}")
    causes: dict[str, int] = {}
    for fail in tally["failures"]:
        causes[fail["error"]] = causes.get(fail["error"], 0) + 1
    print(f"\npublic tests failing on Cairn: {len(tally['failures'])}, by error:")
    for err, n in sorted(causes.items(), key=lambda kv: -kv[1])[: args.show]:
        print(f"  {n:6d}  {err}")
    return {**total, "rate": _rate(total["cairn_passed"], total["public"])}


def main(argv: list[str] | None = None) -> int:
    """Run the chosen peer's test files on the peer and on Cairn; print the rates and a JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("peer", choices=sorted(PEERS))
    parser.add_argument("--files", nargs="*", default=None,
                        help="test files (glob patterns on the path under the tests root or the file name)")
    parser.add_argument("--peer-tests", default=None, help="tests root of a local clone (flax tests/nnx, orbax)")
    parser.add_argument("--map", action="append", default=[], metavar="PEER_MODULE=CAIRN_MODULE",
                        help="extra public-module aliases, e.g. flax.nnx.nn=cairn.nn")
    parser.add_argument("--support", action="append", default=[], metavar="PEER_MODULE",
                        help="a test helper of the peer (e.g. optax._src.test_utils) to load from the peer's "
                             "file with its imports aliased, instead of counting its names as private")
    parser.add_argument("--python", default=sys.executable, help="interpreter with pytest, the peer and Cairn")
    parser.add_argument("--test-timeout", type=int, default=120, help="seconds per test before it fails")
    parser.add_argument("--file-timeout", type=int, default=1800, help="seconds per test file")
    parser.add_argument("--max-hangs", type=int, default=5, help="hung tests per file before giving up on it")
    parser.add_argument("--jobs", type=int, default=1, help="test files run at once")
    parser.add_argument("--out", default=None, help="write the per-test details (private tests, failures) here")
    parser.add_argument("--workdir", default=None,
                        help="keep the copies, configs and pytest logs here (outside the repository) instead of a temp dir")
    parser.add_argument("--reuse-peer", default=None, metavar="WORKDIR",
                        help="take the peer's results from an earlier --workdir of the same files instead of rerunning it")
    parser.add_argument("--retally", default=None, metavar="WORKDIR",
                        help="run nothing: count the peer and Cairn results of an earlier --workdir again")
    parser.add_argument("--no-static", action="store_true",
                        help="count as private only what the run-time trace finds (to see what the static "
                             "analysis of tools/compat_private.py adds)")
    parser.add_argument("--show", type=int, default=15, help="rows in the private-name and failure summaries")
    args = parser.parse_args(argv)
    if args.peer in ("flax", "orbax") and not args.peer_tests:
        parser.error(f"{args.peer} ships no tests in its wheel: pass --peer-tests <clone's tests folder>")
    if args.retally:  # count an earlier run again (e.g. after a change of what counts as private)
        names, settings, peer, cairn = _retally(args)
        static = _static_private(args, pathlib.Path(args.retally), names, settings, peer)
        return _report(args, names, peer, cairn, static)
    with tempfile.TemporaryDirectory(prefix=f"compat_{args.peer}_") as tmp:
        work = pathlib.Path(args.workdir or tmp)
        if args.workdir:
            shutil.rmtree(work, ignore_errors=True)
        names, settings = _prepare(args, work)
        if args.reuse_peer:  # the peer's results of an earlier run of the same files
            peer = json.loads((pathlib.Path(args.reuse_peer) / "peer_results.json").read_text())
        else:
            peer = _run_pytest(args, work, "peer", names, settings)
        (work / "peer_results.json").write_text(json.dumps(peer))
        cairn = _run_pytest(args, work, "cairn", names, settings)
        static = _static_private(args, work, names, settings, peer)
    return _report(args, names, peer, cairn, static)


def _report(args: argparse.Namespace, names: list[str], peer: dict[str, Any], cairn: dict[str, Any],
            static: dict[str, list[str]]) -> int:
    """Print the tally and its JSON line (and write ``--out``)."""
    tally = _tally(names, peer, cairn, static)
    summary = _print(args, tally)
    dist = {"orbax": "orbax-checkpoint"}.get(args.peer, args.peer)
    version = subprocess.run([args.python, "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
                             capture_output=True, text=True).stdout.strip()
    line = {"peer": args.peer, "peer_version": version, "files": len(names), **summary}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({**line, **tally}, indent=1))
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["CompatPrivateAccess", "install_aliases", "main", "public_map", "pytest_configure"]
