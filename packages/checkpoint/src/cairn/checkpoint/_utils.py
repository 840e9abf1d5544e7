"""The helpers Orbax's tutorials call first (``ocp.utils``, ``ocp.test_utils``)."""

from __future__ import annotations

import os
import pathlib
import shutil
from typing import Any

import jax
import numpy as np


def to_shape_dtype_struct(x: Any, dtype: Any = None, scalar_dtype: Any = None) -> Any:
    """The abstract version of a leaf, to restore onto: a ``jax.Array`` becomes a
    ``jax.ShapeDtypeStruct`` with its sharding, a NumPy array one without, a Python scalar
    stays itself (or becomes a 0-d struct of ``scalar_dtype``); ``dtype`` replaces the dtype.

    Args:
      x: a leaf: ``jax.Array``, ``jax.ShapeDtypeStruct``, NumPy array or scalar, or anything else (returned as is).
      dtype: the dtype of the result instead of ``x``'s, or ``None``.
      scalar_dtype: the dtype a Python scalar becomes a 0-d struct of, or ``None`` (kept as is).

    >>> to_shape_dtype_struct(np.zeros((2, 3), np.float32))
    ShapeDtypeStruct(shape=(2, 3), dtype=float32)
    >>> to_shape_dtype_struct(42)
    42
    """
    if isinstance(x, jax.ShapeDtypeStruct):
        return x if dtype is None else jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=x.sharding)
    if isinstance(x, (np.ndarray, np.generic)):
        return jax.ShapeDtypeStruct(np.shape(x), dtype or x.dtype)
    if isinstance(x, (int, float, complex)) and scalar_dtype is not None:
        return jax.ShapeDtypeStruct((), scalar_dtype)
    return x


def erase_and_create_empty(directory: str | os.PathLike) -> pathlib.Path:
    """Remove ``directory`` if it exists, create it empty, return it as a ``pathlib.Path``.

    Args:
      directory: the directory to (re)create, with its parents.

    >>> import tempfile
    >>> p = erase_and_create_empty(tempfile.mkdtemp() + "/ckpts")
    >>> list(p.iterdir())
    []
    """
    path = pathlib.Path(os.fspath(directory))
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path
