"""The dependency-direction contract really fails on a sibling import (and passes on clean trees)."""

import importlib.util
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("depcheck", ROOT / "tools" / "depcheck.py")
depcheck = importlib.util.module_from_spec(spec)
spec.loader.exec_module(depcheck)


def _package(root: pathlib.Path, name: str, code: str, deps=("cairn-core-array",)) -> None:
    src = root / name / "src" / "cairn" / name
    src.mkdir(parents=True)
    (src / "__init__.py").write_text(textwrap.dedent(code))
    dep_list = ", ".join(f'"{d}"' for d in deps)
    (root / name / "pyproject.toml").write_text(f'[project]\nname = "cairn-{name}"\ndependencies = [{dep_list}]\n')


def test_clean_fixture_passes(tmp_path):
    _package(tmp_path, "core_array", "import numpy\n", deps=("numpy",))
    _package(tmp_path, "alpha", "from cairn.core_array import ArraySpec\nfrom cairn.alpha import _x\n")
    assert depcheck.check(tmp_path) == []


SIBLING_IMPORTS = [
    "import cairn.beta",
    "import cairn.beta as b",
    "import cairn.beta.sub as b",
    "import os, cairn.beta",
    "from cairn.beta import thing",
    "from cairn.beta.sub import thing as t",
    "from cairn import beta",
    "from cairn import core_array, beta",
    "from cairn import beta as b",
    "from .. import beta",  # relative, from cairn/alpha/__init__.py: cairn.beta
    "from ..beta import thing",
    "from ..beta.sub import thing",
    "import importlib\nimportlib.import_module('cairn.beta')",
    "from importlib import import_module\nimport_module('cairn.beta.sub')",
    "import importlib\nimportlib.import_module('.beta', 'cairn')",
    "import importlib\nimportlib.import_module('..beta', package='cairn.alpha')",
    "__import__('cairn.beta')",
    "__import__('cairn', fromlist=['beta'])",
    "def f():\n    from cairn import beta\n    return beta",
    "try:\n    import cairn.beta\nexcept ImportError:\n    pass",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cairn.beta import T",
]


@pytest.mark.parametrize("code", SIBLING_IMPORTS)
def test_sibling_import_fails_in_every_form(tmp_path, code):
    _package(tmp_path, "core_array", "import numpy\n", deps=("numpy",))
    _package(tmp_path, "beta", "x = 1\n")
    _package(tmp_path, "alpha", code + "\n")
    (found,) = depcheck.check(tmp_path)
    assert "alpha/src/cairn/alpha/__init__.py:" in found
    assert "cairn.alpha imports sibling cairn.beta" in found


def test_relative_import_in_a_submodule_resolves_against_its_package(tmp_path):
    _package(tmp_path, "beta", "x = 1\n")
    _package(tmp_path, "alpha", "x = 1\n")
    sub = tmp_path / "alpha" / "src" / "cairn" / "alpha" / "deep"
    sub.mkdir()
    (sub / "__init__.py").write_text("from ... import beta\n")  # cairn.alpha.deep -> cairn.beta
    (sub / "_mod.py").write_text("from .. import _own\nfrom ...beta import x\n")  # own package fine, sibling not
    found = depcheck.check(tmp_path)
    assert len(found) == 2, found
    assert found[0].startswith(str(sub / "__init__.py") + ":1:") and "cairn.beta" in found[0]
    assert found[1].startswith(str(sub / "_mod.py") + ":2:") and "cairn.beta" in found[1]


@pytest.mark.parametrize(
    "code",
    [
        "from . import _private\nfrom ._private import y",  # its own package, relatively
        "from .. import core_array",  # the shared protocol, relatively
        "import cairn.core_array as ca\nfrom cairn import core_array",
        "import cairn.alpha._private",
        "import importlib\nimportlib.import_module(name)",  # not a literal: tests_package covers it
        "s = 'cairn.beta is a sibling'",  # a string is not an import
    ],
)
def test_allowed_imports_pass(tmp_path, code):
    _package(tmp_path, "core_array", "import numpy\n", deps=("numpy",))
    _package(tmp_path, "beta", "x = 1\n")
    _package(tmp_path, "alpha", code + "\n")
    assert depcheck.check(tmp_path) == []


@pytest.mark.parametrize("code", ["import cairn.beta\nfrom cairn import core_array", "from cairn.beta.sub import x",
                                  "from .. import beta"])
def test_the_application_layer_may_import_any_library(tmp_path, code):
    _package(tmp_path, "core_array", "import numpy\n", deps=("numpy",))
    _package(tmp_path, "beta", "x = 1\n")
    _package(tmp_path, "llm", code + "\n", deps=("cairn-core-array", "cairn-beta>=0.1"))
    assert depcheck.check(tmp_path) == []


@pytest.mark.parametrize("code", ["import cairn.llm", "from cairn import llm", "from ..llm import generate",
                                  "import importlib\nimportlib.import_module('cairn.llm._model')"])
def test_no_library_imports_the_application_layer(tmp_path, code):
    _package(tmp_path, "core_array", "import numpy\n", deps=("numpy",))
    _package(tmp_path, "llm", "import cairn.beta\n", deps=("cairn-core-array", "cairn-beta"))
    _package(tmp_path, "beta", code + "\n")
    (found,) = depcheck.check(tmp_path)
    assert "beta/src/cairn/beta/__init__.py:" in found
    assert "cairn.beta imports the application layer cairn.llm; no library imports it" in found


def test_no_library_depends_on_the_application_layer(tmp_path):
    _package(tmp_path, "llm", "x = 1\n")
    _package(tmp_path, "beta", "x = 1\n", deps=("cairn-core-array", "cairn-llm>=0.1"))
    (found,) = depcheck.check(tmp_path)
    assert "cairn-beta depends on the application layer 'cairn-llm>=0.1'" in found


def test_the_real_application_layer_imports_libraries():
    """The contract's exception is used for real (so it cannot go stale unnoticed)."""
    imported = set()
    for py in (ROOT / "packages" / "llm" / "src" / "cairn" / "llm").rglob("*.py"):
        module = "cairn.llm." + py.stem
        imported |= {name for _, name in depcheck._imported_cairn_packages(depcheck.ast.parse(py.read_text()), module)}
    assert {"nn", "kernels"} <= imported


def test_relative_import_beyond_the_namespace_is_a_violation(tmp_path):
    _package(tmp_path, "alpha", "from ... import x\n")
    (found,) = depcheck.check(tmp_path)
    assert "beyond the top-level package" in found


def test_empty_folder_fails(tmp_path):
    (found,) = depcheck.check(tmp_path)
    assert "no packages" in found


@pytest.mark.parametrize("dep", ["cairn-beta>=0.1", "cairn_beta", "Cairn-Beta[x]==1", "cairn.beta"])
def test_sibling_dependency_in_pyproject_fails(tmp_path, dep):
    _package(tmp_path, "beta", "x = 1\n")
    _package(tmp_path, "alpha", "x = 1\n", deps=("cairn-core-array", dep))
    (found,) = depcheck.check(tmp_path)
    assert f"depends on sibling {dep!r}" in found


def test_sibling_in_an_extra_fails(tmp_path):
    _package(tmp_path, "alpha", "x = 1\n")
    with (tmp_path / "alpha" / "pyproject.toml").open("a") as f:
        f.write('[project.optional-dependencies]\ntest = ["pytest", "cairn-beta"]\n')
    (found,) = depcheck.check(tmp_path)
    assert "'cairn-beta (extra test)'" in found


def test_namespace_init_is_forbidden(tmp_path):
    _package(tmp_path, "alpha", "x = 1\n")
    (tmp_path / "alpha" / "src" / "cairn" / "__init__.py").write_text("")
    (found,) = depcheck.check(tmp_path)
    assert "PEP 420" in found


@pytest.mark.slow  # subprocesses, 4 s; the contracts are tested in process above and run in `nox -s lint`
def test_cli_exit_codes(tmp_path):
    _package(tmp_path, "beta", "x = 1\n")
    _package(tmp_path, "alpha", "import cairn.beta\n")
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "depcheck.py"), str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 1 and "1 violation" in bad.stdout
    good = subprocess.run([sys.executable, str(ROOT / "tools" / "depcheck.py"), str(ROOT / "packages")], capture_output=True, text=True)
    # the import-cycle half of the CLI is tested in test_tooling_import_cycles.py
    assert "dependency-direction contract: ok" in good.stdout, good.stdout


def test_core_array_and_data_import_without_jax():
    code = "import sys, cairn.core_array as c; c.flatten_with_paths({'a': [1]}); assert 'jax' not in sys.modules, 'jax imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# --- the declared-dependency contract: third-party imports are in the pyproject ---


def _with_extras(root: pathlib.Path, name: str, code: str, deps: tuple[str, ...], extras: dict[str, list[str]]) -> None:
    _package(root, name, code, deps=deps)
    lines = "".join(f"{k} = [{', '.join(repr(d).replace(chr(39), chr(34)) for d in v)}]\n" for k, v in extras.items())
    with open(root / name / "pyproject.toml", "a") as f:
        f.write(f"[project.optional-dependencies]\n{lines}")


DECLARED_CASES = [
    # (code, required deps, extras, expected: None = passes, else a fragment of the message)
    ("import numpy as np\nimport json, os.path\n", ("numpy",), {}, None),  # stdlib is exempt
    ("import optax\n", ("numpy",), {}, "imports 'optax', which is not a required dependency of cairn-alpha"),
    ("from optax import adam\n", ("numpy",), {}, "imports 'optax'"),
    # lazy (in a function) or optional (try/except ImportError): an extra's dependency is enough
    ("def f():\n    import pyarrow\n    return pyarrow\n", ("numpy",), {"parquet": ["pyarrow>=14"]}, None),
    ("try:\n    import pyarrow\nexcept ImportError:\n    pyarrow = None\n", ("numpy",), {"parquet": ["pyarrow>=14"]}, None),
    # an extra's dependency imported when the module is imported breaks a plain install
    ("import pyarrow\n", ("numpy",), {"parquet": ["pyarrow>=14"]}, "it is only in an extra"),
    # the test and bench extras serve the tests, never the library
    ("def f():\n    import optax\n", ("numpy",), {"test": ["optax>=0.2"]}, "not a dependency or a library extra"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import optax\n", ("numpy",), {}, None),
    ("import jaxlib\n", ("jax>=0.4",), {}, None),  # jax's C++ half
    ("import ml_dtypes\n", ("ml-dtypes>=0.4",), {}, None),  # - and _ are one name
]


@pytest.mark.parametrize("code, deps, extras, expected", DECLARED_CASES)
def test_undeclared_third_party_imports_are_named(tmp_path, code, deps, extras, expected):
    _with_extras(tmp_path, "alpha", code, deps, extras)
    found = depcheck.check_third_party(tmp_path)
    if expected is None:
        assert found == []
    else:
        assert len(found) == 1 and expected in found[0] and "__init__.py:" in found[0], found


def test_the_real_packages_declare_what_they_import():
    assert depcheck.check_third_party(ROOT / "packages") == []
