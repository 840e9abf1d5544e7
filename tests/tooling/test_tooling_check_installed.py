"""tools/check_installed.py (run by `nox -s build` and `nox -s tests_package`) really fails.

Each case builds a tiny fake installation under tmp_path (a ``cairn`` namespace, a
``.dist-info`` with a version) and runs the tool with ``python -S`` so that only that
folder is importable: hermetic and fast, and every failure the tool claims to detect is
shown to be detected.
"""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "check_installed.py"


def _install(site: pathlib.Path, pkg: str, code: str | None = None, version: str = "0.1.0",
             requires: tuple[str, ...] = ()) -> None:
    mod = site / "cairn" / pkg
    mod.mkdir(parents=True)
    if code is None:
        code = f"__version__ = {version!r}\n__all__ = ['f']\ndef f():\n    return 1\n"
    (mod / "__init__.py").write_text(code)
    dist = site / f"cairn_{pkg}-{version}.dist-info"
    dist.mkdir()
    lines = ["Metadata-Version: 2.1", f"Name: cairn-{pkg.replace('_', '-')}", f"Version: {version}"]
    (dist / "METADATA").write_text("\n".join(lines + [f"Requires-Dist: {r}" for r in requires]) + "\n")


def _run(site: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-S", str(TOOL), *args], capture_output=True, text=True, env=env, cwd=site)


@pytest.fixture
def site(tmp_path):
    s = tmp_path / "lib" / "site-packages"
    s.mkdir(parents=True)
    return s


@pytest.mark.parametrize("wheel", [False, True])
def test_a_package_alone_passes(site, wheel):
    _install(site, "core_array")
    _install(site, "nn")
    r = _run(site, "nn", *(["--wheel"] if wheel else []))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "cairn.nn 0.1.0 imports alone: ok (1 public names)" in r.stdout


def test_a_sibling_next_to_it_fails(site):
    _install(site, "core_array")
    _install(site, "nn")
    _install(site, "optim")
    r = _run(site, "nn")
    assert r.returncode == 1 and "sibling packages are importable next to cairn.nn: cairn.optim" in r.stdout


def test_declared_cairn_dependencies_may_sit_next_to_it(site):
    """The application layer (cairn-llm) declares the libraries it composes; only those may be there."""
    for lib in ("core_array", "nn", "kernels", "optim"):
        _install(site, lib)
    _install(site, "llm", requires=("cairn-core-array>=0.1,<0.2", "cairn-nn>=0.1", "cairn_kernels", "numpy>=1.26",
                                    'cairn-optim>=0.1; extra == "test"'))
    r = _run(site, "llm")
    # nn and kernels are declared; optim only in an extra, so it must not be installed with it
    assert r.returncode == 1 and "sibling packages are importable next to cairn.llm: cairn.optim" in r.stdout, r.stdout
    (site / "cairn" / "optim" / "__init__.py").unlink()
    (site / "cairn" / "optim").rmdir()
    r = _run(site, "llm")
    assert r.returncode == 0, r.stdout + r.stderr


def test_namespace_init_fails(site):
    _install(site, "core_array")
    (site / "cairn" / "__init__.py").write_text("")
    r = _run(site, "core_array")
    assert r.returncode == 1 and "PEP 420 namespace" in r.stdout


def test_version_mismatch_fails(site):
    _install(site, "core_array", code="__version__ = '0.2.0'\n__all__ = []\n", version="0.1.0")
    r = _run(site, "core_array")
    assert r.returncode == 1
    assert "__version__ is '0.2.0', but the installed distribution cairn-core-array is '0.1.0'" in r.stdout
    assert "has no __all__" in r.stdout


def test_all_naming_a_missing_name_fails(site):
    _install(site, "data", code="__version__ = '0.1.0'\n__all__ = ['gone']\n")
    r = _run(site, "data")
    assert r.returncode == 1 and "names 'gone', which does not exist" in r.stdout


def test_jax_free_packages_must_not_import_or_ship_with_jax(site):
    (site / "jax").mkdir()
    (site / "jax" / "__init__.py").write_text("")
    _install(site, "core_array", code="import jax\n__version__ = '0.1.0'\n__all__ = ['jax']\n")
    r = _run(site, "core_array", "--wheel")
    assert r.returncode == 1
    assert "importing cairn.core_array imported jax" in r.stdout
    assert "JAX is installed alongside cairn-core-array" in r.stdout


def test_wheel_mode_rejects_a_source_tree_import(tmp_path):
    src = tmp_path / "src"
    _install(src, "core_array")
    r = _run(src, "core_array", "--wheel")
    assert r.returncode == 1 and "not from the installed wheel" in r.stdout
