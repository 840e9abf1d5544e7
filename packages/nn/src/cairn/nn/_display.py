"""``nn.display``: show modules, States and Variables (Flax NNX's ``nnx.display``)."""

from __future__ import annotations

import sys
from typing import Any


def _in_ipython() -> bool:
    ipy = sys.modules.get("IPython")
    return ipy is not None and getattr(ipy, "get_ipython", lambda: None)() is not None


def display(*args: Any) -> None:
    """Print each argument's ``repr`` (a module prints as its tree of submodules,
    Variables with shape and dtype, and static settings). In IPython with ``treescope``
    installed, it renders an interactive tree instead.

    Args:
      args: the objects to show.

    >>> from cairn import nn
    >>> nn.display(nn.Param(1.0))
    Param(1.0)
    """
    if _in_ipython():
        try:
            import treescope  # type: ignore[import-not-found]
        except ImportError:
            treescope = None
        if treescope is not None:
            for x in args:
                treescope.display(x, ignore_exceptions=True, autovisualize=True)
            return
    for x in args:
        print(repr(x))
