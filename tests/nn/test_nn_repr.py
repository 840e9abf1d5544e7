"""A module's repr leaves out settings at their ``__init__`` defaults; ``_repr_html_`` renders the
same tree for notebooks (nested ``<details>``, escaped)."""

from __future__ import annotations

from html.parser import HTMLParser

import jax
import jax.numpy as jnp
import numpy as np

from cairn import nn


class _Balanced(HTMLParser):
    """Records tags that are closed out of order or never closed."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack.pop() != tag:
            self.errors.append(tag)


def _balanced(text: str) -> bool:
    p = _Balanced()
    p.feed(text)
    return not p.errors and not p.stack


def test_linear_at_defaults_shows_only_what_was_chosen():
    assert repr(nn.Linear(2, 3, rngs=nn.Rngs(0))) == (
        "Linear(\n"
        "  kernel=Param(float32[2, 3]),\n"
        "  bias=Param(float32[3]),\n"
        "  in_features=2,\n"
        "  out_features=3,\n"
        ")"
    )


def test_settings_that_differ_from_the_default_are_shown():
    r = repr(nn.Linear(2, 3, use_bias=False, param_dtype=jnp.bfloat16, rngs=nn.Rngs(0)))
    assert "use_bias=False" in r and "param_dtype=bfloat16" in r and "kernel=Param(bfloat16[2, 3])" in r
    assert "precision=" not in r and "kernel_init=" not in r and "dot_general=" not in r
    r = repr(nn.Dropout(0.1))
    assert r == "Dropout(\n  rate=0.1,\n)"
    assert "deterministic=True" in repr(nn.Dropout(0.1, deterministic=True))


class _NoTruth:
    """A setting whose ``==`` has no plain truth value (as a NumPy array's)."""

    def __eq__(self, other):
        return np.zeros(2) == 0

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return "NoTruth()"


_ODD = _NoTruth()


def test_user_module_defaults_and_settings_without_plain_equality():
    class Block(nn.Module):
        def __init__(self, d: int, *, act=jax.nn.relu, odd=_ODD, rngs: nn.Rngs):
            self.d, self.act, self.odd = d, act, odd
            self.proj = nn.Linear(d, d, rngs=rngs)

    r = repr(Block(2, rngs=nn.Rngs(0)))
    assert "d=2" in r and "act=" not in r and "proj=Linear(" in r
    assert "odd=" not in r  # the very default object
    # another one: compared safely (no truth-value error), and shown
    assert "odd=NoTruth()" in repr(Block(2, odd=_NoTruth(), rngs=nn.Rngs(0)))
    assert "act=" in repr(Block(2, act=jax.nn.gelu, rngs=nn.Rngs(0)))


def test_html_repr_is_the_same_tree_escaped():
    m = nn.Sequential(nn.Linear(2, 3, rngs=nn.Rngs(0)), nn.Dropout(0.5, rng_collection="<drop>"))
    h = m._repr_html_()
    assert _balanced(h)
    assert h.startswith("<details open><summary><code>Sequential</code>")
    assert "<code>Param(float32[2, 3])</code>" in h and "<code>rate</code> = <code>0.5</code>" in h
    assert "&lt;drop&gt;" in h and "<drop>" not in h
    assert "param_dtype" not in h  # at its default, as in the text repr
    # variables come before settings, as in the text repr
    lin = nn.Linear(2, 3, rngs=nn.Rngs(0))._repr_html_()
    assert lin.index("kernel") < lin.index("in_features")
