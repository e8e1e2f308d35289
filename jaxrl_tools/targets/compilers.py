"""The deviceless compilers: compile-only devices of an accelerator, without the accelerator.

`jax.experimental.topologies.get_topology_desc` gives the devices of a TPU slice (libtpu) or of
GPUs (the CUDA plugin, given a `stream_executor.GpuTargetConfigProto`); a mesh over them makes
`jax.jit(f).lower(...).compile()` run that accelerator's own compiler here. Neither compiler is
in the core install: `toolchain(platform)` says whether one is and how to install it. libtpu
and the CUDA plugin are imported only by `target_devices`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import math
import os

from jaxrl_tools.targets.accelerators import ACCELERATORS, Accelerator

INSTALL = {
    "tpu": "pip install 'jaxrl-tools[aot-tpu]'",
    "cuda": "pip install 'jaxrl-tools[aot-gpu]'",
}
_CUDA_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")


class TargetUnavailable(RuntimeError):
    """The target's compiler is not installed, or would not give its devices (one line)."""


@dataclasses.dataclass(frozen=True)
class Toolchain:
    installed: bool
    detail: str  # what is installed, or the one-line install hint


def toolchain(platform: str) -> Toolchain:
    """Whether the deviceless compiler of `platform` ("tpu", "cuda") is installed (found, not
    imported)."""
    if platform == "tpu":
        found = importlib.util.find_spec("libtpu") is not None
        what = "libtpu"
    elif platform == "cuda":
        found = any(_find(name) for name in _CUDA_PLUGINS)
        what = "the jax CUDA plugin"
    else:
        raise ValueError(f"no deviceless compiler for platform {platform!r}")
    if found:
        return Toolchain(True, what)
    return Toolchain(False, f"{what} is not installed: {INSTALL[platform]}")


def _find(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the namespace package jax_plugins itself is absent
        return False


def gpu_target_config(accelerator: Accelerator | str) -> str:
    """The `stream_executor.GpuTargetConfigProto` (text form) XLA:GPU compiles against: the
    accelerator's device description, and the cuDNN and CUDA runtime versions of the installed
    CUDA plugin (what the program will run with)."""
    a = ACCELERATORS[accelerator] if isinstance(accelerator, str) else accelerator
    if a.gpu is None:
        raise ValueError(f"{a.name} is not a GPU")
    g = dict(a.gpu)
    major, minor = g.pop("compute_capability")
    description = g.pop("device_description")
    g["memory_bandwidth"] = int(g["memory_bandwidth"])
    g["device_memory_size"] = a.hbm_bytes
    fields = "".join(f"  {k}: {v}\n" for k, v in g.items())
    cudnn, runtime = _cuda_build_versions()
    return (
        f"gpu_device_info {{\n{fields}"
        f"  cuda_compute_capability {{\n    major: {major}\n    minor: {minor}\n  }}\n}}\n"
        f'platform_name: "CUDA"\n'
        f"dnn_version_info {{\n{_version(cudnn)}}}\n"
        f"runtime_version {{\n{_version(runtime)}}}\n"
        f'device_description_str: "{description}"\n'
    )


def _version(v: tuple[int, int, int]) -> str:
    return "".join(f"  {k}: {x}\n" for k, x in zip(("major", "minor", "patch"), v))


def _cuda_build_versions() -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(cuDNN, CUDA runtime) versions the installed CUDA plugin was built against; (9.8.0,
    12.8.0) without one."""
    for pkg in ("jax_cuda13_plugin", "jax_cuda12_plugin"):
        try:
            v = importlib.import_module(f"{pkg}._versions")
        except ImportError:
            continue
        dnn, rt = v.cudnn_build_version(), v.cuda_runtime_build_version()  # 91200, 13000
        return (dnn // 10000, dnn // 100 % 100, dnn % 100), (rt // 1000, rt // 10 % 100, 0)
    return (9, 8, 0), (12, 8, 0)


def resolve_topology(
    accelerator: Accelerator, topology: str | None, hosts: int | None, devices: int | None
) -> str:
    """The slice to compile for: `topology` as given (a TPU's may omit its "v5p:" prefix),
    else `hosts` full hosts, else the one of `devices` devices (the mesh's), else the
    accelerator's default."""
    a = accelerator
    if topology:
        if a.platform == "tpu" and ":" not in topology:
            topology = f"{a.name}:{topology}"
        return topology
    if hosts:
        n = hosts * a.chips_per_host
        found = a.topology_for(n)
        if found is None:
            raise TargetUnavailable(
                f"--hosts {hosts}: no {a.label} slice of {n} chips is known; pass --topology"
            )
        return found
    return (a.topology_for(devices) if devices else None) or a.default_topology


def topology_devices(topology: str) -> int:
    """Devices of a topology string: the product of its dimensions."""
    return math.prod(int(x) for x in topology.split(":")[-1].lower().split("x"))


def target_devices(name: str, topology: str | None = None, hosts: int | None = None) -> list:
    """The compile-only devices of `topology` (default: the accelerator's) of accelerator
    `name`: what a mesh is built over to compile for it here.

    Raises:
      TargetUnavailable: the toolchain is not installed or gives no devices (one line).
    """
    a = ACCELERATORS[name]
    tc = toolchain(a.platform)
    if not tc.installed:
        raise TargetUnavailable(tc.detail)
    topology = resolve_topology(a, topology, hosts, None)
    return list(_devices(a.name, topology))


@functools.lru_cache(maxsize=16)
def _devices(name: str, topology: str) -> tuple:
    from jax.experimental import topologies  # noqa: PLC0415

    a = ACCELERATORS[name]
    prepare(a.platform)
    try:
        if a.platform == "tpu":
            # libtpu's default host is 2x2x1 chips: a smaller slice is one host of its size
            dims = [int(x) for x in topology.split(":")[-1].split("x")]
            small = {"chips_per_host_bounds": (dims + [1, 1])[:3]} if math.prod(dims) < 4 else {}
            desc = topologies.get_topology_desc(platform="tpu", topology_name=topology, **small)
        else:
            config = gpu_target_config(a)
            try:
                desc = topologies.get_topology_desc(
                    platform="cuda", topology=topology, target_config=config
                )
            except NotImplementedError:  # the plugin was not registered: see _register_cuda
                _register_cuda()
                desc = topologies.get_topology_desc(
                    platform="cuda", topology=topology, target_config=config
                )
    except TargetUnavailable:
        raise
    except Exception as e:  # noqa: BLE001 - libtpu / the plugin: any failure is one line
        message = " ".join(str(e).split())[:300]
        raise TargetUnavailable(
            f"{a.compiler} gave no devices for topology {topology!r}: {message}"
        ) from None
    return tuple(desc.devices)


def _register_cuda() -> None:
    """Registers the CUDA plugin for compiling only. On a host without a GPU its start-up check
    of the CUDA libraries fails (cuPTI needs a driver) and jax leaves the plugin unregistered;
    compiling needs none of them, so the check is skipped and the plugin registered again."""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    for name in _CUDA_PLUGINS:
        if _find(name):
            try:
                importlib.import_module(name).initialize()
            except Exception as e:  # noqa: BLE001
                raise TargetUnavailable(
                    f"the jax CUDA plugin did not register: {' '.join(str(e).split())[:200]}"
                ) from None
            _run_plugin_callbacks("cuda")
            return
    raise TargetUnavailable(f"the jax CUDA plugin is not installed: {INSTALL['cuda']}")


def _run_plugin_callbacks(name: str) -> None:
    """What jax does for each plugin it discovers, for one registered late: the callbacks that
    register custom-call partitioners (`custom_partitioning`, e.g. cuDNN attention's) with it.
    jax has no public call for this; without it the partitioner finds no handler for the
    platform."""
    from jax._src import xla_bridge as xb  # noqa: PLC0415

    factory = getattr(xb, "_backend_factories", {}).get(name)
    c_api = getattr(factory, "c_api", None)
    if c_api is None:
        return
    with xb._plugin_callback_lock:
        for callback in list(getattr(xb, "_plugin_callbacks", [])):
            callback(c_api=c_api)


def prepare(platform: str) -> None:
    """Call before jax starts its backends (the first `jax.devices()`), in a process that will
    compile for `platform`: on a host without a GPU the CUDA plugin registers (its check of the
    CUDA libraries, which needs a driver, skipped) instead of printing a traceback, whichever
    platform is planned for; on a host without a TPU, libtpu loads in several processes at once
    (it holds /tmp/libtpu_lockfile, meant for the processes sharing a TPU: a second compiling
    process would be refused)."""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    if platform == "tpu" and _tpu_chips() == 0:
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def _tpu_chips() -> int | None:
    """TPU chips attached to this host (None: unknown)."""
    try:
        from jax._src import hardware_utils  # noqa: PLC0415

        return hardware_utils.num_available_tpu_chips_and_device_id()[0]
    except Exception:  # noqa: BLE001 - a private helper: unknown, and nothing is changed
        return None


# ------------------------------------------------------------------------------------------------
# The work of one run of a compiled executable, from its HLO
