"""Static shape / dtype checks shared by the public functions of ``jaxrl_tools.algorithms``.

Every check reads only static properties (``.shape``, ``.dtype``), so it runs at trace time and
costs nothing under ``jax.jit``. Each failure is a one-line ValueError of the form
``"<function>: <argument> has shape (6, 9), expected (6, 10) (the shape of logp_BT)"``.
"""

from __future__ import annotations

import numpy as np


def shape_of(x) -> tuple[int, ...]:
    return tuple(np.shape(x))


def dtype_of(x) -> np.dtype:
    dtype = getattr(x, "dtype", None)
    return np.dtype(dtype) if dtype is not None else np.asarray(x).dtype


def check_ndim(fn: str, name: str, x, layout: str) -> None:
    """``x`` must have as many axes as ``layout`` (e.g. "[B, T]") names."""
    ndim = len(layout.strip("[]").split(","))
    if len(shape_of(x)) != ndim:
        raise ValueError(f"{fn}: {name} has shape {shape_of(x)}, expected {layout} ({ndim} axes)")


def check_shape(fn: str, name: str, x, expected: tuple[int, ...], why: str) -> None:
    """``x.shape`` must equal ``expected``; ``why`` says where the expected shape comes from."""
    if shape_of(x) != tuple(expected):
        raise ValueError(
            f"{fn}: {name} has shape {shape_of(x)}, expected {tuple(expected)} ({why})"
        )


def check_like(fn: str, ref_name: str, ref, **others) -> None:
    """Every array in ``others`` that is not None must have exactly the shape of ``ref``."""
    for name, x in others.items():
        if x is not None:
            check_shape(fn, name, x, shape_of(ref), f"the shape of {ref_name}")


def check_int(fn: str, name: str, x, what: str) -> None:
    """``x`` must have an integer dtype (ids used as indices, never floats or bools)."""
    dtype = dtype_of(x)
    if not np.issubdtype(dtype, np.integer):
        raise ValueError(f"{fn}: {name} has dtype {dtype}, expected an integer dtype ({what})")


def check_scalar(fn: str, name: str, x) -> None:
    """``x`` must be a scalar (a [B] value would broadcast the loss to [B])."""
    if x is not None and shape_of(x) != ():
        raise ValueError(f"{fn}: {name} has shape {shape_of(x)}, expected a scalar ()")
