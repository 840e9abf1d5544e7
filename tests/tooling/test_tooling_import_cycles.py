"""The import-cycle contract (tools/depcheck.py): no cycle inside a package unless every edge is labelled."""

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

LABEL = "# import cycle (labelled): base classes and their method sugar"


def _package(root: pathlib.Path, files: dict[str, str], name: str = "alpha") -> pathlib.Path:
    """A package folder ``root/name`` whose ``cairn/<name>`` holds ``files`` (relative path -> code)."""
    src = root / name / "src" / "cairn" / name
    src.mkdir(parents=True)
    (root / name / "pyproject.toml").write_text(f'[project]\nname = "cairn-{name}"\ndependencies = []\n')
    files = {"__init__.py": "", **files}
    for rel, code in files.items():
        path = src / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(code))
    return src


def test_acyclic_package_passes(tmp_path):
    src = _package(tmp_path, {
        "__init__.py": "from cairn.alpha._a import A\nfrom cairn.alpha._b import B\n",
        "_a.py": "from cairn.alpha._b import B\nA = B\n",
        "_b.py": "import os\nfrom cairn.core_array import x\nB = 1\n",
    })
    assert depcheck.check_cycles(src) == []


def test_two_module_cycle_names_both_edges(tmp_path):
    src = _package(tmp_path, {"_a.py": "from cairn.alpha._b import B\n", "_b.py": "import os\nfrom cairn.alpha._a import A\n"})
    (found,) = depcheck.check_cycles(src)
    assert "_a -> _b -> _a" in found
    assert f"{src / '_a.py'}:1" in found and f"{src / '_b.py'}:2" in found


def test_three_module_cycle_is_named_in_order(tmp_path):
    src = _package(tmp_path, {
        "_a.py": "from cairn.alpha._b import B\n",
        "_b.py": "from cairn.alpha._c import C\n",
        "_c.py": "x = 1\n\n\ndef f():\n    from cairn.alpha._a import A  # function-local imports count\n    return A\n",
    })
    (found,) = depcheck.check_cycles(src)
    assert "_a -> _b -> _c -> _a" in found
    assert f"{src / '_c.py'}:5" in found


CYCLE_SPELLINGS = [
    "from cairn.alpha._a import A",
    "from cairn.alpha import _a",
    "import cairn.alpha._a",
    "import cairn.alpha._a as a",
    "from . import _a",
    "from ._a import A",
    "from .._a import A",  # from the subpackage cairn/alpha/sub
    "try:\n    from cairn.alpha._a import A\nexcept ImportError:\n    A = None",
    "import importlib\nimportlib.import_module('cairn.alpha._a')",
]


@pytest.mark.parametrize("spelling", CYCLE_SPELLINGS)
def test_every_import_spelling_is_an_edge(tmp_path, spelling):
    where = "sub/_b.py" if spelling.startswith("from .._a") else "_b.py"
    target = "cairn.alpha.sub._b" if where.startswith("sub") else "cairn.alpha._b"
    src = _package(tmp_path, {"_a.py": f"import {target}\n", where: spelling + "\n", "sub/__init__.py": ""})
    (found,) = depcheck.check_cycles(src)
    assert "_a -> _b -> _a" in found


def test_name_from_the_package_init_points_at_the_init(tmp_path):
    # ``from cairn.alpha import A`` runs cairn/alpha/__init__.py, which imports _a: a real cycle
    src = _package(tmp_path, {"__init__.py": "from cairn.alpha._a import A\n", "_a.py": "from cairn.alpha import helper\nA = 1\n"})
    (found,) = depcheck.check_cycles(src)
    assert "cairn.alpha -> _a -> cairn.alpha" in found


def test_importing_a_submodule_does_not_count_as_importing_its_package(tmp_path):
    src = _package(tmp_path, {"__init__.py": "from cairn.alpha._a import A\n", "_a.py": "from cairn.alpha._b import B\nA = B\n", "_b.py": "B = 1\n"})
    assert depcheck.check_cycles(src) == []


def test_type_checking_imports_do_not_count(tmp_path):
    src = _package(tmp_path, {
        "_a.py": "from cairn.alpha._b import B\n",
        "_b.py": "from typing import TYPE_CHECKING\nimport typing\nif TYPE_CHECKING:\n    from cairn.alpha._a import A\n"
                 "if typing.TYPE_CHECKING:\n    import cairn.alpha._a\n",
    })
    assert depcheck.check_cycles(src) == []


def test_the_else_of_type_checking_counts(tmp_path):
    src = _package(tmp_path, {
        "_a.py": "from cairn.alpha._b import B\n",
        "_b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    pass\nelse:\n    from cairn.alpha._a import A\n",
    })
    assert len(depcheck.check_cycles(src)) == 1


@pytest.mark.parametrize("above", [True, False])
def test_fully_labelled_cycle_passes(tmp_path, above):
    def edge(code: str) -> str:
        return f"{LABEL}\n{code}\n" if above else f"{code}  {LABEL}\n"

    src = _package(tmp_path, {
        "_a.py": edge("from cairn.alpha._b import B"),
        "_b.py": "x = 1\n\n\ndef f():\n    " + edge("from cairn.alpha._a import A").replace("\n", "\n    ") + "return A\n",
    })
    assert depcheck.check_cycles(src) == []


def test_label_on_a_multiline_import_counts(tmp_path):
    src = _package(tmp_path, {
        "_a.py": f"from cairn.alpha._b import (  {LABEL}\n    B,\n    C,\n)\n",
        "_b.py": f"from cairn.alpha._a import (\n    A,\n)  {LABEL}\n",
    })
    assert depcheck.check_cycles(src) == []


def test_a_cycle_with_one_unlabelled_edge_fails(tmp_path):
    src = _package(tmp_path, {"_a.py": f"{LABEL}\nfrom cairn.alpha._b import B\n", "_b.py": "from cairn.alpha._a import A\n"})
    (found,) = depcheck.check_cycles(src)
    assert "_a -> _b -> _a" in found or "_b -> _a -> _b" in found
    assert "(labelled)" in found  # the labelled edge is marked as such in the report


def test_one_unlabelled_site_makes_the_edge_unlabelled(tmp_path):
    src = _package(tmp_path, {
        "_a.py": f"{LABEL}\nfrom cairn.alpha._b import B\n",
        "_b.py": f"{LABEL}\nfrom cairn.alpha._a import A\n\n\ndef f():\n    from cairn.alpha._a import A2\n    return A2\n",
    })
    (found,) = depcheck.check_cycles(src)
    assert f"{src / '_b.py'}:6" in found


def test_labelled_cycle_does_not_hide_a_second_cycle(tmp_path):
    src = _package(tmp_path, {
        "_a.py": f"{LABEL}\nfrom cairn.alpha._b import B\n",
        "_b.py": f"{LABEL}\nfrom cairn.alpha._a import A\nfrom cairn.alpha._c import C\n",
        "_c.py": "from cairn.alpha._b import B\n",
    })
    (found,) = depcheck.check_cycles(src)
    assert "_b -> _c -> _b" in found


def test_stale_label_fails(tmp_path):
    src = _package(tmp_path, {"_a.py": f"{LABEL}\nfrom cairn.alpha._b import B\n", "_b.py": "B = 1\n"})
    (found,) = depcheck.check_cycles(src)
    assert found.startswith(f"{src / '_a.py'}:2:") and "lies on no cycle" in found


def test_every_unlabelled_edge_is_reported(tmp_path):
    # two cycles sharing _a: both must show up
    src = _package(tmp_path, {
        "_a.py": "from cairn.alpha._b import B\nfrom cairn.alpha._c import C\n",
        "_b.py": "from cairn.alpha._a import A\n",
        "_c.py": "from cairn.alpha._a import A\n",
    })
    found = depcheck.check_cycles(src)
    assert len(found) == 2
    assert any("_a -> _b -> _a" in f for f in found) and any("_a -> _c -> _a" in f for f in found)


def test_self_import_and_other_packages_are_not_cycles(tmp_path):
    src = _package(tmp_path, {"_a.py": "import cairn.alpha._a\nfrom cairn.beta._a import x\nimport numpy\n"})
    assert depcheck.check_cycles(src) == []


def test_cli_reports_cycles_and_fails(tmp_path):
    _package(tmp_path, {"_a.py": "from cairn.alpha._b import B\n", "_b.py": "from cairn.alpha._a import A\n"})
    for args in ([str(tmp_path)], ["--cycles", str(tmp_path)], ["--cycles", str(tmp_path / "alpha")]):
        r = subprocess.run([sys.executable, str(ROOT / "tools" / "depcheck.py"), *args], capture_output=True, text=True)
        assert r.returncode == 1, r.stdout
        assert "import-cycle contract: 1 problem(s)" in r.stdout and "_a -> _b -> _a" in r.stdout


def test_real_packages_have_no_unlabelled_import_cycle():
    """Issue 14: nn and data have no import cycle but data's labelled base-class one."""
    found = depcheck.check_all_cycles(ROOT / "packages")
    assert found == [], "\n".join(found)
