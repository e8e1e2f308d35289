"""Building a (data, fsdp, tensor) device mesh."""

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

MESH_AXES = ("data", "fsdp", "tensor")


def parse_mesh_shape(shape: str | Sequence[int] | Mapping[str, int]) -> tuple[int, int, int]:
    """Normalises a mesh shape: "2x2x2", (2, 2, 2) or {"data": 2, "fsdp": 2, "tensor": 2}.

    One entry may be -1: it takes whatever the device count leaves.
    """
    if isinstance(shape, str):
        try:
            dims = tuple(int(s) for s in shape.lower().split("x"))
        except ValueError:
            raise ValueError(f"mesh shape {shape!r} is not of the form DATAxFSDPxTENSOR") from None
    elif isinstance(shape, Mapping):
        unknown = set(shape) - set(MESH_AXES)
        if unknown:
            raise ValueError(f"unknown mesh axes {sorted(unknown)}; valid axes are {MESH_AXES}")
        dims = tuple(int(shape.get(a, 1)) for a in MESH_AXES)
    else:
        dims = tuple(int(s) for s in shape)
    if len(dims) != len(MESH_AXES):
        raise ValueError(f"mesh shape {shape!r} needs {len(MESH_AXES)} sizes for {MESH_AXES}")
    if any(d == 0 or d < -1 for d in dims) or dims.count(-1) > 1:
        raise ValueError(f"mesh shape {shape!r}: sizes must be positive, with at most one -1")
    return dims  # type: ignore[return-value]


def make_mesh(
    shape: str | Sequence[int] | Mapping[str, int] = (1, -1, 1),
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A mesh with axes ("data", "fsdp", "tensor") over `devices` (default: all devices).

    Raises:
      ValueError: the shape's product does not equal the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    dims = list(parse_mesh_shape(shape))
    if -1 in dims:
        known = int(np.prod([d for d in dims if d != -1]))
        if len(devices) % known:
            raise ValueError(
                f"mesh shape {tuple(dims)} does not divide the {len(devices)} available devices"
            )
        dims[dims.index(-1)] = len(devices) // known
    if int(np.prod(dims)) != len(devices):
        raise ValueError(
            f"mesh shape {tuple(dims)} (= {int(np.prod(dims))} devices) does not match the "
            f"{len(devices)} available devices"
        )
    try:
        mesh_devices = mesh_utils.create_device_mesh(dims, devices)
    except Exception:  # noqa: BLE001 - topology-aware layout is only a preference
        mesh_devices = np.asarray(devices).reshape(dims)
    return Mesh(mesh_devices, MESH_AXES)
