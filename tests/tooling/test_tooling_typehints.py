"""tools/typehints.py: every public signature under packages/*/src is fully annotated."""

import importlib.util
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("typehints", ROOT / "tools" / "typehints.py")
typehints = importlib.util.module_from_spec(spec)
spec.loader.exec_module(typehints)


def _check(code: str) -> list[str]:
    return typehints.check_source(textwrap.dedent(code), "m.py")


def test_fully_annotated_passes():
    code = """
    from __future__ import annotations

    def f(a: int, /, b: str = "", *args: int, c: float, **kw: object) -> None: ...

    async def g() -> int: ...

    class C:
        def __init__(self, x: int) -> None: ...
        def __call__(self, y: int) -> int: ...
        @classmethod
        def make(cls) -> C: ...
        @staticmethod
        def s(x: int) -> int: ...
        @property
        def p(self) -> int: ...
    """
    assert _check(code) == []


@pytest.mark.parametrize(
    ("code", "missing"),
    [
        ("def f(a) -> None: ...", "a"),
        ("def f(a: int): ...", "return"),
        ("def f(a: int, /, b) -> None: ...", "b"),
        ("def f(*args) -> None: ...", "*args"),
        ("def f(*, k) -> None: ...", "k"),
        ("def f(**kw) -> None: ...", "**kw"),
        ("async def f(a: int): ...", "return"),
        ("class C:\n    def m(self, x) -> None: ...", "x"),
        ("class C:\n    def __init__(self, x: int): ...", "return"),  # -> None is asked for too
        ("class C:\n    def __call__(self, x) -> int: ...", "x"),
        ("class C:\n    @staticmethod\n    def s(x) -> None: ...", "x"),  # no self to skip
        ("class C:\n    @classmethod\n    def c(cls): ...", "return"),
        ("class C:\n    class Inner:\n        def m(self): ...", "return"),
        ("import sys\nif sys.version_info >= (3, 11):\n    def f(a): ...", "a, return"),
        ("try:\n    import x\nexcept ImportError:\n    def f(a): ...", "a, return"),
    ],
)
def test_unannotated_public_signature_fails(code, missing):
    (found,) = _check(code)
    assert found.startswith("m.py:") and found.endswith(f"lacks annotations for {missing}"), found


def test_message_names_the_qualified_function_and_line():
    (found,) = _check("\n\nclass Linear:\n    def apply(self, x): ...\n")
    assert found == "m.py:4: Linear.apply lacks annotations for x, return"


@pytest.mark.parametrize(
    "code",
    [
        "def _private(a): ...",
        "class C:\n    def _helper(self, a): ...",
        "class C:\n    def __repr__(self): ...",  # other dunders are not checked
        "class C:\n    def __eq__(self, other): ...",
        "class _Private:\n    def run(self, a): ...",
        "class C:\n    class _Inner:\n        def run(self, a): ...",
        "def f() -> None:\n    def inner(a): ...\n    return None",
        "def __getattr__(name): ...",  # a module-level dunder is not a method
        "lam = lambda a: a",
    ],
)
def test_private_and_nested_are_not_checked(code):
    assert _check(code) == []


def test_private_module_public_names_count(tmp_path):
    src = tmp_path / "alpha" / "src" / "cairn" / "alpha"
    src.mkdir(parents=True)
    (src / "_topic.py").write_text("def api(x): ...\n")
    (src / "__init__.py").write_text("from cairn.alpha._topic import api\n")
    files = typehints.source_files([str(tmp_path)])
    assert files == [src / "__init__.py", src / "_topic.py"]
    (found,) = typehints.check_source((src / "_topic.py").read_text(), "_topic.py")
    assert "api lacks annotations for x, return" in found


def test_cli(tmp_path):
    pkg = tmp_path / "alpha" / "src" / "cairn" / "alpha"
    pkg.mkdir(parents=True)
    (pkg / "_a.py").write_text("def f(x): ...\n")
    tool = str(ROOT / "tools" / "typehints.py")
    bad = subprocess.run([sys.executable, tool, str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 1 and "1 public signature(s) not fully annotated" in bad.stdout
    (pkg / "_a.py").write_text("def f(x: int) -> int: ...\n")
    good = subprocess.run([sys.executable, tool, str(tmp_path / "alpha" / "src")], capture_output=True, text=True)
    assert good.returncode == 0, good.stdout
