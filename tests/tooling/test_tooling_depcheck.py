"""The dependency-direction contract really fails on a sibling import (and passes on clean trees)."""

import importlib.util
import pathlib
import subprocess
import sys
import textwrap

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


def test_sibling_import_fails_in_every_form(tmp_path):
    _package(tmp_path, "core_array", "import numpy\n", deps=("numpy",))
    _package(tmp_path, "beta", "x = 1\n")
    _package(
        tmp_path,
        "alpha",
        """
        import cairn.beta
        from cairn.beta import thing
        from cairn import beta
        def f():
            import importlib
            return importlib.import_module("cairn.beta")
        """,
    )
    found = depcheck.check(tmp_path)
    assert len(found) == 4, found
    assert all("cairn.alpha imports sibling cairn.beta" in v for v in found)


def test_sibling_dependency_in_pyproject_fails(tmp_path):
    _package(tmp_path, "beta", "x = 1\n")
    _package(tmp_path, "alpha", "x = 1\n", deps=("cairn-core-array", "cairn-beta>=0.1"))
    (found,) = depcheck.check(tmp_path)
    assert "depends on sibling 'cairn-beta>=0.1'" in found


def test_namespace_init_is_forbidden(tmp_path):
    _package(tmp_path, "alpha", "x = 1\n")
    (tmp_path / "alpha" / "src" / "cairn" / "__init__.py").write_text("")
    (found,) = depcheck.check(tmp_path)
    assert "PEP 420" in found


def test_cli_exit_codes(tmp_path):
    _package(tmp_path, "beta", "x = 1\n")
    _package(tmp_path, "alpha", "import cairn.beta\n")
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "depcheck.py"), str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 1 and "1 violation" in bad.stdout
    good = subprocess.run([sys.executable, str(ROOT / "tools" / "depcheck.py"), str(ROOT / "packages")], capture_output=True, text=True)
    assert good.returncode == 0, good.stdout


def test_core_array_and_data_import_without_jax():
    code = "import sys, cairn.core_array as c; c.flatten_with_paths({'a': [1]}); assert 'jax' not in sys.modules, 'jax imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
