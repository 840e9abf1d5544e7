"""One checker for every iterator's ``set_state``: version, keys, and each field's type
and range, with errors that name the iterator, the field's path and what was expected.

Every state an iterator returns from ``get_state()`` carries ``"version": STATE_VERSION``.
A state without ``"version"`` (written by cairn-data 0.1.0, before versions existed) is
read as version 1 when it is otherwise valid, so old checkpoints keep resuming.

Nested states (``mix`` holds its inputs' states, ``FirstFitPack`` its parent's) are
checked by the nested iterator itself; :func:`nested` adds the outer field to the path
of any error raised inside, so the message names the full path in the nested state
(``inputs/1/next_index``), in the ``/``-joined convention of ``cairn.core_array``.

>>> check_state({"version": 1, "index": 3}, "mix iterator", {"index": int_field(0, 10)})
{'version': 1, 'index': 3}
>>> try:
...     check_state({"index": "5"}, "mix iterator", {"index": int_field(0, 10)})
... except ValueError as e:
...     print(e)
invalid mix iterator state at 'index': expected an int in [0, 10], got '5'
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

from cairn.data._arguments import int_at_least as _int_at_least

__all__ = ["STATE_VERSION", "StateError", "check_state", "int_field", "nested", "with_version"]

STATE_VERSION = 1
SUPPORTED_VERSIONS = (1,)

Check = Callable[[Any], str | None]  # returns what was expected, or None when valid


class _Missing:
    def __repr__(self) -> str:
        return "nothing (the key is missing)"


MISSING = _Missing()


class StateError(ValueError):
    """An iterator state that ``set_state`` cannot accept.

    Attributes: ``kind`` (the iterator), ``path`` (the field, ``/``-joined, ``""`` for the
    whole state), ``expected`` and ``got``.
    """

    def __init__(self, kind: str, path: str, expected: str, got: Any) -> None:
        self.kind, self.path, self.expected, self.got = kind, path, expected, got
        super().__init__(self._text())

    def _text(self) -> str:
        where = f"at {self.path!r}" if self.path else "(the whole state)"
        got = repr(self.got)
        if len(got) > 200:
            got = got[:200] + "..."
        return f"invalid {self.kind} state {where}: expected {self.expected}, got {got}"

    def under(self, prefix: str) -> StateError:
        """Put ``prefix`` (the path of the nested state, e.g. ``"inputs/1"``) in front of
        the path; both are already paths in core_array's convention, so they join with
        its separator."""
        self.path = f"{prefix}/{self.path}" if self.path else prefix
        self.args = (self._text(),)
        return self


@contextlib.contextmanager
def nested(prefix: str | int) -> Iterator[None]:
    """Errors of a nested iterator's ``set_state`` get ``prefix`` in front of their path."""
    try:
        yield
    except StateError as e:
        raise e.under(str(prefix)) from None


def int_field(lo: int = 0, hi: int | None = None) -> Check:
    """An int (not a bool, not a float, not a string) in ``[lo, hi]`` (``hi=None``: no bound)."""
    want = f"an int in [{lo}, {hi}]" if hi is not None else f"an int >= {lo}"

    def check(v: Any) -> str | None:
        if not _int_at_least(v, lo) or (hi is not None and v > hi):
            return want
        return None

    return check


def any_field(v: Any) -> str | None:
    """A field checked by its nested iterator (its own ``set_state``)."""
    return None


def check_state(
    state: Any, kind: str, fields: Mapping[str, Check], optional: Collection[str] = ()
) -> dict:
    """Check ``state`` against ``fields`` (name -> check) plus ``version``; return it.

    Keys in ``optional`` may be absent (states written before the field existed).
    Raises :class:`StateError` (a ``ValueError``) for a non-dict, an unknown version,
    a missing or unknown key, or a field that fails its check.
    """
    if not isinstance(state, dict):
        raise StateError(kind, "", f"a dict with keys {['version', *fields]}", state)
    version = state.get("version", 1)
    if not _int_at_least(version, 1) or version not in SUPPORTED_VERSIONS:
        raise StateError(
            kind,
            "version",
            f"one of {list(SUPPORTED_VERSIONS)} (this cairn-data reads state versions "
            f"{list(SUPPORTED_VERSIONS)}; a newer one was written by a newer cairn-data)",
            version,
        )
    for key in state:
        if key != "version" and key not in fields:
            raise StateError(
                kind,
                str(key),
                f"no field {key!r} (the fields are {['version', *fields]})",
                state[key],
            )
    for key, check in fields.items():
        if key not in state:
            if key in optional:
                continue
            raise StateError(kind, key, f"a value (fields: {['version', *fields]})", MISSING)
        want = check(state[key])
        if want is not None:
            raise StateError(kind, key, want, state[key])
    return state


def with_version(state: dict) -> dict:
    """``{"version": STATE_VERSION, **state}``: what ``get_state`` returns."""
    return {"version": STATE_VERSION, **state}
