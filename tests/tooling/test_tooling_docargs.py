"""tools/docargs.py: every public callable in a package's ``__all__`` names its parameters in ``Args:``."""

import dataclasses
import importlib.util
import pathlib
import subprocess
import sys
import types
import typing

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("docargs", ROOT / "tools" / "docargs.py")
docargs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(docargs)


def test_args_section_entries_with_and_without_types_and_stars():
    doc = """Do it.

    Args:
      x: the input; a long description that
        wraps onto an indented line with fake: colon
      y (int): a count.
      *args: more.
      **kwargs: options.

    Returns:
      z: not a parameter.
    """
    assert docargs.documented_args(doc) == {"x", "y", "args", "kwargs"}


def test_no_args_section_documents_nothing():
    assert docargs.documented_args("x: looks like an entry but is no section") == set()
    assert docargs.documented_args(None) == set()


def f_ok(a: int, *rest: int, b: int = 0, **kw: int) -> None:
    """F.

    Args:
      a: a.
      *rest: rest.
      b: b.
      **kw: kw.
    """


def f_half(a: int, b: int) -> None:
    """F.

    Args:
      a: a.
    """


def f_none(a: int) -> None:
    """No section."""


def f_noparams() -> None:
    """Nothing to document."""


def f_private_param(*_args: object, **_kwargs: object) -> None:
    """Takes and ignores anything (Orbax's signature)."""


class InitDoc:
    """A class documenting its arguments in ``__init__``."""

    def __init__(self, size: int) -> None:
        """Build.

        Args:
          size: how big.
        """


@dataclasses.dataclass(frozen=True)
class Options:
    """Options.

    Args:
      steps: how many.
    """

    steps: int = 1
    rate: float = 0.1


class Pair(typing.NamedTuple):
    """A pair, undocumented."""

    left: int
    right: int


class MyError(ValueError):
    """Keeps ValueError's constructor: nothing of ours to document."""


class SubInit(InitDoc):
    """Inherits a Cairn-defined constructor, but this test module is not a cairn module."""


@pytest.mark.parametrize(
    ("obj", "missing"),
    [
        (f_ok, []),
        (f_half, ["b"]),
        (f_none, ["a"]),
        (f_noparams, None),
        (f_private_param, None),
        (InitDoc, []),
        (Options, ["rate"]),
        (Pair, ["left", "right"]),
        (MyError, None),
        (SubInit, None),  # the constructor comes from a non-Cairn class (this test module)
        (3, None),
    ],
)
def test_missing_args(obj, missing):
    assert docargs.missing_args(obj) == missing


def test_todo_list_must_shrink_exactly(monkeypatch, tmp_path):
    mod = types.ModuleType("cairn.fakepkg")
    mod.__all__ = ["f_ok", "f_half", "f_none", "sub"]
    mod.f_ok, mod.f_half, mod.f_none = f_ok, f_half, f_none
    sub = types.ModuleType("cairn.fakepkg.sub")
    sub.__all__ = ["Pair"]
    sub.Pair = Pair
    mod.sub = sub
    monkeypatch.setitem(sys.modules, "cairn.fakepkg", mod)
    monkeypatch.setitem(sys.modules, "cairn.fakepkg.sub", sub)
    found, stale = docargs.problems(["fakepkg"], {"cairn.fakepkg.f_half", "cairn.fakepkg.f_ok", "cairn.fakepkg.gone"})
    assert found == [
        "cairn.fakepkg.f_ok: documented now, remove it from tools/docargs_todo.txt",
        "cairn.fakepkg.f_none: its docstring's Args: section does not name a",
        "cairn.fakepkg.sub.Pair: its docstring's Args: section does not name left, right",
    ]
    assert stale == {"cairn.fakepkg.gone"}
    todo = tmp_path / "todo.txt"
    todo.write_text("# comment\ncairn.a.b  # why\n\n")
    assert docargs.read_todo(todo) == {"cairn.a.b"}


class Base:
    """A Cairn base class (its module is set below)."""

    def __init__(self) -> None:
        """Nothing to document."""

    def run(self, steps: int) -> None:
        """Run.

        Args:
          steps: how many.
        """

    def _helper(self, x: int) -> None:
        """Private: not checked."""


class Child(Base):
    """A Cairn class deriving from Base."""

    def extra(self, y: int) -> None:
        """No Args section."""

    @staticmethod
    def make(z: int) -> None:
        """No Args section either."""

    @property
    def size(self) -> int:
        """A property: not checked."""
        return 1


Base.__module__ = Child.__module__ = "cairn.fakepkg._topic"


def test_public_methods_of_exported_classes_are_checked_once(monkeypatch):
    assert [name for name, _ in docargs.public_methods(Child)] == ["extra", "make", "run"]
    mod = types.ModuleType("cairn.fakepkg")
    mod.__all__ = ["Base", "Child"]
    mod.Base, mod.Child = Base, Child
    monkeypatch.setitem(sys.modules, "cairn.fakepkg", mod)
    names = [q for q, _ in docargs.public_callables("fakepkg")]
    # Base.run is reached again through Child: reported once, under the first name
    assert names == ["cairn.fakepkg.Base", "cairn.fakepkg.Base.run", "cairn.fakepkg.Child",
                     "cairn.fakepkg.Child.extra", "cairn.fakepkg.Child.make"]
    found, _ = docargs.problems(["fakepkg"], set())
    assert found == ["cairn.fakepkg.Child.extra: its docstring's Args: section does not name y",
                     "cairn.fakepkg.Child.make: its docstring's Args: section does not name z"]


def test_every_package_passes_with_the_todo_list():
    found, stale = docargs.problems(docargs.all_packages(), docargs.read_todo())
    assert found == [] and stale == set(), "\n".join(found + sorted(stale))


@pytest.mark.parametrize("package", ["checkpoint", "core_array"])
def test_finished_packages_have_no_todo_entries(package):
    assert not {t for t in docargs.read_todo() if t.startswith(f"cairn.{package}.")}


def test_cli_rejects_an_unknown_package():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "docargs.py"), "nosuch"], capture_output=True, text=True)
    assert r.returncode == 2 and "no such package ['nosuch']" in r.stdout


def test_type_aliases_and_field_default_lambdas_are_not_callables_to_document():
    """``Params = Any`` / ``A | B`` aliases carry no docstring, and a lambda in a dataclass body
    is a field's default value, not a method: neither is checked; a real method still is."""

    @dataclasses.dataclass(frozen=True)
    class Holder:
        pick: typing.Callable[..., int] = lambda *a: 0

        def run(self, steps: int) -> None:
            """Run (no Args section)."""

    Holder.__module__ = "cairn.fake"
    assert docargs.missing_args(typing.List[int]) is None  # noqa: UP006 - a typing alias on purpose
    assert docargs.missing_args(int | str) is None
    assert [name for name, _ in docargs.public_methods(Holder)] == ["run"]
    assert docargs.missing_args(Holder.run) == ["steps"]
