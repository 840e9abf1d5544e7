"""Helpers the tests of several packages share (tests/conftest.py puts this folder on
``sys.path``; import it as ``from _cairn_testlib import ...``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def central_diff(f: Callable[[np.ndarray], float], x, h: float = 1e-6) -> np.ndarray:
    """Central finite differences of a scalar float64 NumPy function of one array."""
    x = np.array(x, np.float64)
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[i] += h
        xm[i] -= h
        g[i] = (f(xp) - f(xm)) / (2 * h)
    return g


def record_quant_sites(provider) -> list:
    """Every site a ``cairn.quant`` provider handles, as ``(kind, module_path, index)``, in order
    (the provider is changed in place; the list grows as it runs)."""
    seen: list = []
    inner = provider._handle

    def handle(site, invals):
        seen.append((site.kind, site.module_path, site.index))
        return inner(site, invals)

    provider._handle = handle
    return seen
