"""The accelerators `jaxrl-tools plan` compiles for without one, from their vendors' figures.

`ACCELERATORS`: per device, the HBM a plan must fit in, the dense bf16 peak and the HBM bandwidth
its floors are computed with (each entry's `source`), the slices it comes in, and for a GPU the
device description XLA:GPU is given (`compilers.gpu_target_config`).
"""

from __future__ import annotations

import dataclasses

# The GpuDeviceInfoProto of a Hopper GH100 SXM5 part (compute capability 9.0): NVIDIA's H100
# datasheet (132 SMs on the SXM5 board, 1,980 MHz max boost, 50 MB L2) and the CUDA C
# Programming Guide's table for compute capability 9.0 (228 KiB shared memory per SM, 227 KiB
# per block opted in, 48 KiB by default, 64K 32-bit registers per SM and per block, 2,048
# threads per SM, 1,024 per block, warps of 32; 128 FP32 cores per SM: the Hopper whitepaper).
# The field set is XLA's (xla/stream_executor/device_description.proto); the H200 is the same
# GH100 with HBM3e.
_GH100 = dict(
    threads_per_block_limit=1024,
    threads_per_warp=32,
    shared_memory_per_block=48 * 1024,
    shared_memory_per_core=228 * 1024,
    threads_per_core_limit=2048,
    core_count=132,
    fpus_per_core=128,
    block_dim_limit_x=2**31 - 1,
    block_dim_limit_y=65535,
    block_dim_limit_z=65535,
    l2_cache_size=50 * 2**20,
    clock_rate_ghz=1.98,
    shared_memory_per_block_optin=227 * 1024,
    registers_per_core_limit=65536,
    registers_per_block_limit=65536,
    compute_capability=(9, 0),
)


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One accelerator `plan` knows, per device (a GPU, a TPU chip).

    Attributes:
      name: the `--accelerator` name.
      platform: "cuda" or "tpu" (`jax.experimental.topologies.get_topology_desc`'s).
      label: how it is called in what `plan` prints.
      hbm_bytes: the device memory a plan must fit in.
      peak_flops: dense bf16 matmul FLOP/s.
      hbm_bandwidth: HBM bytes/s.
      default_topology: the slice compiled for when neither the mesh nor the command names one.
      source: where the figures come from.
      chips_per_host: devices per host of a multi-host slice (`--hosts`).
      topologies: TPU: chips -> the slice shape of that many chips (libtpu's topology names).
      gpu: GPU: the device description given to XLA:GPU (`gpu_target_config`).
    """

    name: str
    platform: str
    label: str
    hbm_bytes: int
    peak_flops: float
    hbm_bandwidth: float
    default_topology: str
    source: str
    chips_per_host: int = 8
    topologies: dict[int, str] | None = None
    gpu: dict | None = None

    @property
    def compiler(self) -> str:
        """The compiler that produces this target's figures, as `plan` labels them."""
        if self.platform == "tpu":
            return f"TPU compiler ({self.name})"
        return f"XLA:GPU (deviceless, {self.label})"

    def topology_for(self, devices: int) -> str | None:
        """The slice of `devices` devices (None: no such slice)."""
        if self.platform == "cuda":
            if devices <= self.chips_per_host:
                return f"1x1x{devices}"
            hosts, rest = divmod(devices, self.chips_per_host)
            return None if rest else f"1x{hosts}x{self.chips_per_host}"
        shape = (self.topologies or {}).get(devices)
        return None if shape is None else f"{self.name}:{shape}"


_TPU_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_TPU_3D = {
    1: "1x1x1",
    4: "2x2x1",
    8: "2x2x2",
    16: "2x2x4",
    32: "2x4x4",
    64: "4x4x4",
    128: "4x4x8",
    256: "4x8x8",
    512: "8x8x8",
    1024: "8x8x16",
}
_GCP = "Google Cloud TPU docs, docs.cloud.google.com/tpu/docs/"

ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator(
            "h100-80g",
            "cuda",
            "H100 80GB",
            hbm_bytes=80 * 10**9,
            peak_flops=989e12,
            hbm_bandwidth=3.35e12,
            default_topology="1x1x8",
            source="NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: 80 GB HBM3, 3.35 TB/s, "
            "BF16 Tensor Core 1,979 TFLOPS with sparsity (989 dense)",
            gpu=dict(_GH100, memory_bandwidth=3.35e12, device_description="NVIDIA H100 80GB HBM3"),
        ),
        Accelerator(
            "h200",
            "cuda",
            "H200 141GB",
            hbm_bytes=141 * 10**9,
            peak_flops=989e12,
            hbm_bandwidth=4.8e12,
            default_topology="1x1x8",
            source="NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: 141 GB HBM3e, 4.8 TB/s, "
            "BF16 Tensor Core 1,979 TFLOPS with sparsity (989 dense)",
            gpu=dict(_GH100, memory_bandwidth=4.8e12, device_description="NVIDIA H200"),
        ),
        Accelerator(
            "v5e",
            "tpu",
            "TPU v5e",
            hbm_bytes=16 * 2**30,
            peak_flops=197e12,
            hbm_bandwidth=819e9,
            default_topology="v5e:2x2",
            source=_GCP + "v5e: 197 TFLOPs bf16 per chip, HBM2 16 GB at 819 GBps",
            chips_per_host=4,
            topologies=_TPU_2D,
        ),
        Accelerator(
            "v5p",
            "tpu",
            "TPU v5p",
            hbm_bytes=95 * 2**30,
            peak_flops=459e12,
            hbm_bandwidth=2765e9,
            default_topology="v5p:2x2x1",
            source=_GCP + "v5p: 459 TFLOPs bf16 per chip, HBM2e 95 GB at 2765 GBps",
            chips_per_host=4,
            topologies=_TPU_3D,
        ),
        Accelerator(
            "v6e",
            "tpu",
            "TPU v6e",
            hbm_bytes=32 * 2**30,
            peak_flops=918e12,
            hbm_bandwidth=1638e9,
            default_topology="v6e:2x2",
            source=_GCP + "v6e: 918 TFLOPs bf16 per chip, HBM 32 GB at 1638 GBps",
            chips_per_host=4,
            topologies=_TPU_2D,
        ),
    )
}
