"""Device profiles for the memory planner: capacity, host link, peak FLOP/s, host memory.

Every number comes from the vendor's datasheet unless marked as an assumption; "measured" link
rates are the usual sustained figures for pinned-memory copies (about 80% of the theoretical PCIe
rate), not measurements made by this project. The planner only needs rough rates: they set the
predicted step-time overhead, never whether a plan fits.

Profiles (per GPU; "link" is per direction, theoretical / typical sustained):

- ``a100``: A100 80GB PCIe. 80 GB HBM2e; PCIe Gen4 x16, 32 / ~25 GB/s; dense 312 TFLOP/s BF16,
  156 TF32; host 256 GB (DGX A100: 2 TB for 8 GPUs).
- ``h100``: H100 80GB SXM. 80 GB HBM3; PCIe Gen5 x16, 64 / ~50 GB/s; 989 BF16, 494 TF32; host
  256 GB (DGX H100).
- ``h200``: H200 141GB SXM. 141 GB HBM3e; PCIe Gen5 x16, 64 / ~50 GB/s; 989 BF16, 494 TF32; host
  256 GB (DGX H200).
- ``gh200``: GH200 Grace Hopper, 96 GB HBM3 (``gh200-144gb``: 144 GB HBM3e); NVLink-C2C, 900 GB/s
  bidirectional = 450 / ~380 GB/s; 989 BF16, 494 TF32; host 480 GB LPDDR5X.
- ``gb200``: one Blackwell GPU of a GB200 superchip. 186 GB HBM3e; NVLink-C2C 450 / ~380 GB/s
  (shared by the superchip's two GPUs); 2500 BF16 (5 PF per two GPUs), 1250 TF32; host 240 GB
  (480 GB LPDDR5X per two GPUs).
- ``dgx-spark``: DGX Spark (GB10). 128 GB unified LPDDR5x at 273 GB/s, shared by CPU and GPU: no
  host link, offloading gains no capacity; ~125 BF16, ~62 TF32 (assumption, below).

TPU profiles (per chip; Google Cloud TPU documentation, "TPU v4", "TPU v5e", "TPU v5p" and "TPU
v6e" pages: HBM capacity and bandwidth, peak bf16 TFLOP/s; host memory per chip from the smallest
machine type of each, e.g. ``ct5lp-hightpu-1t``: 1 chip, 48 GB):

- ``tpu-v5e``: 16 GiB HBM2 at 819 GB/s; 197 TFLOP/s bf16; host 48 GiB. JAX names it ``TPU v5 lite``.
- ``tpu-v5p``: 95 GiB HBM2e at 2,765 GB/s; 459 TFLOP/s bf16; host 112 GiB (448 GB per 4 chips).
- ``tpu-v6e``: 32 GiB HBM at 1,640 GB/s; 918 TFLOP/s bf16; host 176 GiB (``ct6e-standard-1t``).
  JAX names it ``TPU v6 lite``.
- ``tpu-v4``: 32 GiB HBM2 at 1,200 GB/s; 275 TFLOP/s bf16; host 100 GiB (407 GB per 4 chips).

A TPU's host link is not published as a figure. :data:`TPU_V5E_LINK` is what this project measured
on one v5e chip inside a jitted program (the way the transforms move data; ``python -m
benchmarks.accelerator_check --configs bandwidth``, results under ``benchmarks/results/``); the
other TPU profiles assume the same rate until measured. float32 matmuls on a TPU run, at JAX's
default precision, as bfloat16 passes: ``flops_tf32`` is the bf16 rate there. The TPU runtime itself
holds host memory once the chip is open (``host_runtime_bytes``: 13.5 GiB measured on a v5e host,
assumed for the others), which the planner takes from the host's RAM.

``device="auto"`` (:func:`detect_device`) reads the running device's ``device_kind`` and the
machine's RAM (the smaller of ``/proc/meminfo`` and a cgroup limit, shared by its local devices).

Compute capability (the GPU generation; it bounds the head width cuDNN's fused attention takes,
256 from Hopper, 9.0, on and 128 before, see :func:`zoo.nn.cudnn_max_head_dim`): A100 8.0 (Ampere);
H100, H200 and GH200 9.0 (Hopper); GB200 10.0 (Blackwell); DGX Spark's GB10 12.1 (NVIDIA CUDA GPUs
compute-capability table). A custom device has none unless given (then cuDNN is planned for heads up
to 128 only).

Memory bandwidth (device memory, peak, from the same datasheets; it bounds decode speed, see
``transforms/plan/_decode.py``): A100 80GB PCIe 1,935 GB/s (HBM2e); H100 SXM 3.35 TB/s (HBM3);
H200 4.8 TB/s (HBM3e); GH200 96 GB 4 TB/s (HBM3), 144 GB 4.9 TB/s (HBM3e); GB200 8 TB/s per GPU
(NVL72: 576 TB/s over 72 GPUs); DGX Spark 273 GB/s (the unified LPDDR5x).

Sources: NVIDIA A100 Tensor Core GPU datasheet (80GB PCIe: 312 TF BF16 dense, 156 TF TF32, PCIe
Gen4 64 GB/s bidirectional); NVIDIA H100 datasheet (SXM: 989 TF BF16 dense, 494 TF TF32, PCIe Gen5
128 GB/s bidirectional); NVIDIA H200 datasheet (141 GB HBM3e, same compute as H100 SXM); NVIDIA
GH200 Grace Hopper Superchip datasheet (96 GB HBM3 or 144 GB HBM3e, 480 GB LPDDR5X, NVLink-C2C
900 GB/s bidirectional); NVIDIA GB200 NVL72 datasheet (per GPU 186 GB HBM3e, 5 PF dense BF16 per
two-GPU superchip, 480 GB LPDDR5X per Grace CPU, NVLink-C2C 900 GB/s); NVIDIA DGX Spark datasheet
(GB10, 128 GB unified LPDDR5x at 273 GB/s, 1 PFLOP sparse FP4). DGX host memory: NVIDIA DGX
A100/H100/H200 user guides (2 TB per 8-GPU system).

Assumptions, stated rather than hidden:

- **DGX Spark BF16.** NVIDIA quotes only 1 PFLOP of *sparse FP4*. Halving for dense (500 TF FP4),
  halving again per doubling of precision (FP4 -> FP8 -> BF16) gives ~125 TFLOP/s dense BF16; TF32
  half of that. Treat these as rough.
- **Sustained link rates.** PCIe: ~78% of theoretical (25 of 32, 50 of 64 GB/s), the usual
  pinned-memory `cudaMemcpy` figure. NVLink-C2C: ~85% (380 of 450 GB/s).
- **float32 compute** is timed at the TF32 tensor-core rate: XLA's default precision for float32
  matmuls on Ampere and later GPUs (``jax_default_matmul_precision="highest"`` would be several
  times slower).
- **Capacities** are binary (GiB): HBM and LPDDR parts are sized in powers of two, and ``nvidia-smi``
  reports a little less than the nominal figure as usable.
- **Unified memory** (DGX Spark): offloading to "host" moves bytes within the same memory, so it
  gains no capacity; the planner never recommends host offload there (recomputation still helps).

Host limits also include XLA's pinned-host allocator: the XLA GPU client reserves pinned host memory
through a pool capped by the environment variable ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` (default 64
GiB, per GPU), which must be raised before JAX starts when a plan keeps more than that in
``pinned_host``. Device memory available to XLA is ``XLA_CLIENT_MEM_FRACTION`` (or the older
``XLA_PYTHON_CLIENT_MEM_FRACTION``) of the device's memory, default 0.75: JAX preallocates 75% of
GPU memory (newer releases may grow the pool beyond it; the planner does not count on that).
"""

from __future__ import annotations

import dataclasses
import os

GB = 1e9
GiB = 2**30

#: The platforms a profile may name (JAX's names).
PLATFORMS = ("gpu", "tpu")

#: The XLA GPU client's pinned-host pool limit variable (GiB, default 64; see xla/pjrt/gpu/gpu_helpers.cc).
PINNED_HOST_LIMIT_VAR = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
PINNED_HOST_LIMIT_DEFAULT_GIB = 64
#: JAX's device-memory preallocation fraction variables (the newer name wins, as in jaxlib).
MEM_FRACTION_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
MEM_FRACTION_DEFAULT = 0.75


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """One accelerator as the planner sees it (all numbers per device).

    **Fields:**

    - `name`, `description`: how the profile is shown.
    - `memory_bytes`: device (HBM) capacity.
    - `link_bytes_per_s`: sustained host <-> device copy rate, per direction (full duplex).
    - `link_peak_bytes_per_s`: theoretical rate of the link, per direction (shown only).
    - `flops_bf16`, `flops_tf32`: dense peak FLOP/s for 16-bit and float32 (TF32) matmuls.
    - `host_memory_bytes`: host memory available to this device (``None``: unknown, unlimited).
    - `unified`: host and device share one physical memory (offload gains no capacity).
    - `link`: the name of the host link.
    - `sources`: where the numbers come from.
    - `memory_bytes_per_s`: peak device-memory bandwidth (``None``: unknown; needed to bound
      decode speed in :func:`transforms.plan.plan_generate`).
    - `compute_capability`: the GPU generation, e.g. ``8.0`` (A100) or ``9.0`` (H100); it decides
      which head widths ``attention="auto"`` is planned with cuDNN's kernel for (``None``: unknown,
      heads up to 128; see :func:`zoo.nn.resolve_attention`).
    - `platform`: JAX's platform name for the device, ``"gpu"`` or ``"tpu"`` (cuDNN's attention
      exists on a GPU only).
    - `device_kinds`: the ``jax.Device.device_kind`` strings of this device (``"TPU v5 lite"``,
      ``"NVIDIA H200"``): :func:`profile_for_kind` and ``device="auto"`` find the profile by them.
    - `host_runtime_bytes`: host memory the accelerator's runtime holds once the device is open
      (the planner counts it against ``host_memory_bytes``).
    - `heap_overhead`: the planner's allowance for packing the program's temporaries into device
      memory, as a fraction of them: 0.15 on a GPU (XLA's buffer assignment and the allocator leave
      gaps; measured on an H200), 0 on a TPU (a v5e's compiled steps held within 2% of the live bytes
      the planner counts, where 0.15 put it 13-23% above them).
    - `compute_efficiency`: the fraction of the peak FLOP/s a train step achieves, which turns the
      planner's matmul FLOPs into time (:func:`transforms.plan`'s default): 1.0 where unmeasured;
      0.38 on a v5e, where ``llama:small``'s step without offload (batch 8 x 1024, attention
      through the TPU kernel that ``"auto"`` chooses there) took 0.0790 s against the 29.7 ms its
      FLOPs need at the peak (``benchmarks/results/accelerator_check_TPU_v5_lite_20261206T125434Z.md``;
      0.35 with blockwise attention, 0.0859 s in ``..._095814Z``). With 0.35 the planner's offload
      costs on that chip came near the measured ones (the streamed update 1.53x ``none`` against
      1.27x measured, weights in host memory 2.25x against 2.40-2.54x, where the peak rate
      predicted 2.26x and 4.53x).

    Make a custom one with :func:`custom_device`.
    """

    name: str
    description: str
    memory_bytes: int
    link_bytes_per_s: float | int
    link_peak_bytes_per_s: float | int
    flops_bf16: float | int
    flops_tf32: float | int
    host_memory_bytes: int | None
    unified: bool = False
    link: str = ""
    sources: tuple[str, ...] = ()
    memory_bytes_per_s: float | int | None = None
    compute_capability: float | None = None
    platform: str = "gpu"
    device_kinds: tuple[str, ...] = ()
    host_runtime_bytes: int = 0
    heap_overhead: float = 0.15
    compute_efficiency: float = 1.0

    def __post_init__(self):
        if self.platform not in PLATFORMS:
            raise ValueError(f"DeviceProfile.platform must be one of {PLATFORMS}, got {self.platform!r}")
        if not isinstance(self.host_runtime_bytes, int) or self.host_runtime_bytes < 0:
            raise ValueError(f"DeviceProfile.host_runtime_bytes must be an int >= 0, got {self.host_runtime_bytes!r}")
        for field in ("memory_bytes", "link_bytes_per_s", "link_peak_bytes_per_s", "flops_bf16", "flops_tf32"):
            value = getattr(self, field)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"DeviceProfile.{field} must be a positive number, got {value!r}")
        eff = self.compute_efficiency
        if not isinstance(eff, int | float) or isinstance(eff, bool) or not 0 < eff <= 1:
            raise ValueError(f"DeviceProfile.compute_efficiency must be in (0, 1], got {eff!r}")
        if self.host_memory_bytes is not None and not self.host_memory_bytes > 0:
            raise ValueError(
                f"DeviceProfile.host_memory_bytes must be positive or None, got {self.host_memory_bytes!r}"
            )
        bw = self.memory_bytes_per_s
        if bw is not None and (not isinstance(bw, int | float) or isinstance(bw, bool) or not bw > 0):
            raise ValueError(f"DeviceProfile.memory_bytes_per_s must be a positive number or None, got {bw!r}")
        cc = self.compute_capability
        if cc is not None and (not isinstance(cc, int | float) or isinstance(cc, bool) or not cc > 0):
            raise ValueError(f"DeviceProfile.compute_capability must be a positive number or None, got {cc!r}")

    @property
    def host_available_bytes(self) -> int | None:
        """Host memory left for the training state once the runtime holds its share (None: unknown)."""
        if self.host_memory_bytes is None:
            return None
        return max(self.host_memory_bytes - self.host_runtime_bytes, 0)

    def flops(self, compute_dtype: str) -> float:
        """Peak dense matmul FLOP/s for activations in ``compute_dtype``."""
        return self.flops_tf32 if compute_dtype == "float32" else self.flops_bf16

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


#: The share of a TPU's HBM its programs may use: the runtime keeps 0.25 of a v5e's 16 GiB (its
#: ``memory_stats()["bytes_limit"]`` is 15.75 GiB). JAX's preallocation fraction is a GPU setting.
TPU_USABLE_FRACTION = 15.75 / 16
#: GB/s per direction of a TPU v5e's host link inside a jitted program (see :data:`TPU_V5E_LINK`):
#: host to device measured at 14.1 GB/s (4 GiB copies; 13.5 at 256 MiB), 2026-12-05. Device to host
#: into fresh pinned buffers ran at 0.4-0.7 GB/s (the host faulting its pages in; transparent huge
#: pages were off), while train steps that write offloaded state back into donated buffers moved
#: >= 4.9 GB/s out; the same rate is assumed both ways until the donated copy is measured.
TPU_LINK_GB_S = 14.0
_PCIE4 = dict(link="PCIe Gen4 x16", link_bytes_per_s=25 * GB, link_peak_bytes_per_s=32 * GB)
_PCIE5 = dict(link="PCIe Gen5 x16", link_bytes_per_s=50 * GB, link_peak_bytes_per_s=64 * GB)
_C2C = dict(link="NVLink-C2C", link_bytes_per_s=380 * GB, link_peak_bytes_per_s=450 * GB)
_HOPPER = dict(flops_bf16=989e12, flops_tf32=494e12, compute_capability=9.0)


def _dgx(chip: str, description: str, memory_gib: int, memory_gb_s: int, **more) -> DeviceProfile:
    """One GPU of an 8-GPU DGX server (2 TB of host memory: 256 GiB per GPU), from its datasheets."""
    return DeviceProfile(
        name=chip.lower(),
        description=description,
        memory_bytes=memory_gib * GiB,
        memory_bytes_per_s=memory_gb_s * GB,
        host_memory_bytes=256 * GiB,
        sources=(f"NVIDIA {chip} Tensor Core GPU datasheet", f"NVIDIA DGX {chip} user guide (2 TB host / 8 GPUs)"),
        **more,
    )


def _grace_hopper(name: str, memory: str, memory_gib: int, memory_gb_s: int, kinds: tuple[str, ...]) -> DeviceProfile:
    """A GH200 superchip: a Hopper GPU with ``memory`` (``"96 GB HBM3"``) and 480 GiB of Grace memory over C2C."""
    return DeviceProfile(
        name=name,
        description=f"NVIDIA GH200 Grace Hopper ({memory})",
        memory_bytes=memory_gib * GiB,
        memory_bytes_per_s=memory_gb_s * GB,
        host_memory_bytes=480 * GiB,
        sources=("NVIDIA GH200 Grace Hopper Superchip datasheet",),
        device_kinds=kinds,
        **_HOPPER,
        **_C2C,
    )


#: The host link of a TPU v5e chip as measured here inside a jitted program (per direction, each
#: alone; see the module docstring); the other TPU profiles assume it too.
TPU_V5E_LINK = dict(link="TPU host link (PCIe; measured in-program on a v5e)", link_bytes_per_s=TPU_LINK_GB_S * GB)


#: A v5e's measured share of its peak FLOP/s in a train step (see ``DeviceProfile.compute_efficiency``).
TPU_V5E_COMPUTE_EFFICIENCY = 0.38


def _tpu(
    gen: str,
    memory_gib: int,
    memory_gb_s: int,
    tflops: int,
    host_gib: int,
    kinds: tuple[str, ...],
    *,
    runtime_gib: float = 13.5,
) -> DeviceProfile:
    """One Cloud TPU chip of generation ``gen`` from Google's published figures (see the module docstring)."""
    measured = " (host link measured here)" if gen == "v5e" else " (host link assumed: the v5e's, measured here)"
    return DeviceProfile(
        name=f"tpu-{gen}",
        description=f"Google Cloud TPU {gen} (one chip, {memory_gib} GiB HBM)",
        memory_bytes=memory_gib * GiB,
        memory_bytes_per_s=memory_gb_s * GB,
        flops_bf16=tflops * 1e12,
        flops_tf32=tflops * 1e12,  # float32 matmuls run as bf16 passes at JAX's default precision
        host_memory_bytes=host_gib * GiB,
        platform="tpu",
        heap_overhead=0.0,
        compute_efficiency=TPU_V5E_COMPUTE_EFFICIENCY if gen == "v5e" else 1.0,
        device_kinds=kinds,
        host_runtime_bytes=int(runtime_gib * GiB),
        link_peak_bytes_per_s=TPU_LINK_GB_S * GB,
        sources=(f"Google Cloud TPU {gen} documentation (HBM, bandwidth, bf16 peak, machine types){measured}",),
        **{k: v for k, v in TPU_V5E_LINK.items() if k != "link_peak_bytes_per_s"},
    )


DEVICES: dict[str, DeviceProfile] = {
    "a100": _dgx(
        "A100",
        "NVIDIA A100 80GB PCIe",
        80,
        1935,
        flops_bf16=312e12,
        flops_tf32=156e12,
        compute_capability=8.0,
        device_kinds=("NVIDIA A100 80GB PCIe", "NVIDIA A100-PCIE-80GB", "NVIDIA A100-SXM4-80GB"),
        **_PCIE4,
    ),
    "h100": _dgx(
        "H100", "NVIDIA H100 80GB SXM", 80, 3350, device_kinds=("NVIDIA H100 80GB HBM3",), **_HOPPER, **_PCIE5
    ),
    "h200": _dgx("H200", "NVIDIA H200 141GB SXM", 141, 4800, device_kinds=("NVIDIA H200",), **_HOPPER, **_PCIE5),
    "gh200": _grace_hopper("gh200", "96 GB HBM3", 96, 4000, ("NVIDIA GH200 480GB",)),
    "gh200-144gb": _grace_hopper("gh200-144gb", "144 GB HBM3e", 144, 4900, ("NVIDIA GH200 144G HBM3e",)),
    "gb200": DeviceProfile(
        name="gb200",
        memory_bytes_per_s=8000 * GB,
        description="NVIDIA GB200 Grace Blackwell (one GPU, 186 GB HBM3e)",
        memory_bytes=186 * GiB,
        flops_bf16=2500e12,
        flops_tf32=1250e12,
        host_memory_bytes=240 * GiB,
        compute_capability=10.0,
        device_kinds=("NVIDIA GB200",),
        sources=("NVIDIA GB200 NVL72 datasheet (per GPU: 186 GB HBM3e; 5 PF dense BF16 per 2-GPU superchip)",),
        **_C2C,
    ),
    "dgx-spark": DeviceProfile(
        name="dgx-spark",
        memory_bytes_per_s=273 * GB,
        description="NVIDIA DGX Spark (GB10, 128 GB unified LPDDR5x)",
        memory_bytes=128 * GiB,
        link="unified memory (273 GB/s LPDDR5x)",
        link_bytes_per_s=273 * GB,
        link_peak_bytes_per_s=273 * GB,
        flops_bf16=125e12,
        flops_tf32=62.5e12,
        host_memory_bytes=128 * GiB,
        unified=True,
        compute_capability=12.1,
        device_kinds=("NVIDIA GB10",),
        sources=("NVIDIA DGX Spark datasheet (1 PFLOP sparse FP4; BF16 rate is an assumption)",),
    ),
    "tpu-v5e": _tpu("v5e", 16, 819, 197, 48, ("TPU v5 lite", "TPU v5e"), runtime_gib=13.5),
    "tpu-v5p": _tpu("v5p", 95, 2765, 459, 112, ("TPU v5", "TPU v5p")),
    "tpu-v6e": _tpu("v6e", 32, 1640, 918, 176, ("TPU v6 lite", "TPU v6e")),
    "tpu-v4": _tpu("v4", 32, 1200, 275, 100, ("TPU v4",)),
}

ALIASES = {
    "v5e": "tpu-v5e",
    "v5litepod": "tpu-v5e",
    "v5p": "tpu-v5p",
    "v6e": "tpu-v6e",
    "trillium": "tpu-v6e",
    "v4": "tpu-v4",
    "a100-80gb": "a100",
    "h100-sxm": "h100",
    "h200-141gb": "h200",
    "gh200-96gb": "gh200",
    "spark": "dgx-spark",
    "gb10": "dgx-spark",
}


def custom_device(
    *,
    memory_gb: float | int,
    link_gb_s: float | int,
    tflops: float | int,
    tflops_fp32: float | int | None = None,
    host_memory_gb: float | int | None = None,
    unified: bool = False,
    name: str = "custom",
    memory_bw_gb_s: float | int | None = None,
    compute_capability: float | None = None,
) -> DeviceProfile:
    """A device profile from three numbers: memory (GiB), host link per direction (GB/s), peak TFLOP/s.

    `tflops` is the dense 16-bit matmul rate; `tflops_fp32` (default half of it) the float32 one.
    `host_memory_gb` (GiB) bounds what may be offloaded; `unified=True` marks host and device as
    one memory (then the planner recommends no host offload). `memory_bw_gb_s` (GB/s) is the
    device-memory bandwidth, which bounds decode speed (:func:`transforms.plan.plan_generate`).
    `compute_capability` (e.g. ``8.6``) is the GPU generation, which bounds the head width planned
    with cuDNN's attention kernel (``None``: unknown, heads up to 128).

    **Example:**

    ```python
    import transforms
    dev = transforms.custom_device(memory_gb=24, link_gb_s=25, tflops=165)   # e.g. a 24 GB PCIe card
    dev.memory_bytes == 24 * 2**30   # True
    ```
    """
    checked = [("memory_gb", memory_gb), ("link_gb_s", link_gb_s), ("tflops", tflops)]
    if memory_bw_gb_s is not None:
        checked.append(("memory_bw_gb_s", memory_bw_gb_s))
    for label, value in checked:
        if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
            raise ValueError(f"custom_device: {label} must be a positive number, got {value!r}")
    return DeviceProfile(
        name=name,
        description=f"custom ({memory_gb:g} GB, {link_gb_s:g} GB/s link, {tflops:g} TFLOP/s)",
        memory_bytes=int(memory_gb * GiB),
        link_bytes_per_s=link_gb_s * GB,
        link_peak_bytes_per_s=link_gb_s * GB,
        flops_bf16=tflops * 1e12,
        flops_tf32=(tflops / 2 if tflops_fp32 is None else tflops_fp32) * 1e12,
        host_memory_bytes=None if host_memory_gb is None else int(host_memory_gb * GiB),
        unified=unified,
        link="custom link",
        sources=("given by the user",),
        memory_bytes_per_s=None if memory_bw_gb_s is None else memory_bw_gb_s * GB,
        compute_capability=compute_capability,
    )


def _kind_key(kind: str) -> str:
    return "".join(ch for ch in kind.lower() if ch.isalnum())


def profile_for_kind(device_kind: str) -> DeviceProfile | None:
    """The profile whose :attr:`DeviceProfile.device_kinds` holds ``device_kind`` (JAX's
    ``jax.Device.device_kind``, compared without case, spaces or punctuation), or None.

    **Example:**

    ```python
    from transforms.plan import profile_for_kind
    profile_for_kind("TPU v5 lite").name   # 'tpu-v5e'
    ```
    """
    key = _kind_key(device_kind)
    return next((p for p in DEVICES.values() if key in {_kind_key(k) for k in p.device_kinds}), None)


def host_memory_bytes() -> int | None:
    """This machine's RAM: ``MemTotal`` of ``/proc/meminfo``, or the cgroup's memory limit where
    smaller (a container); None where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                raw = f.read().strip()
            if raw.isdigit() and int(raw) < 2**60:
                found.append(int(raw))
        except OSError:
            continue
    return min(found) if found else None


def host_available_bytes() -> int | None:
    """Host memory available now: ``MemAvailable`` of ``/proc/meminfo`` (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def detect_device(jax_device=None, *, host_bytes: int | None = None) -> DeviceProfile:
    """The profile of the running accelerator (``device="auto"``): the profile of ``jax_device``'s
    (default ``jax.local_devices()[0]``) ``device_kind``, with ``host_memory_bytes`` this
    machine's RAM (``host_bytes``, default :func:`host_memory_bytes`) shared by its local devices.

    Raises `ValueError` in one line on a CPU or an accelerator with no profile, naming the device
    kind and the profiles known (give one by name, or :func:`custom_device`).
    """
    import jax

    if jax_device is None:
        jax_device = jax.local_devices()[0]
    kind, platform = jax_device.device_kind, jax_device.platform
    profile = profile_for_kind(kind) if platform in PLATFORMS else None
    if profile is None:
        what = f"{kind!r} (platform {platform!r}), which has no profile"
        what = "the CPU (no accelerator)" if platform == "cpu" else what
        raise ValueError(
            f"device='auto': JAX runs on {what}; name a profile instead, one of {sorted(DEVICES)}, "
            "or pass transforms.custom_device(memory_gb=..., link_gb_s=..., tflops=...)"
        )
    host = host_memory_bytes() if host_bytes is None else host_bytes
    if host:
        sharing = max(1, sum(1 for d in jax.local_devices() if d.platform == platform))
        profile = dataclasses.replace(
            profile,
            host_memory_bytes=host // sharing,
            description=f"{profile.description}; host {host / GiB:.0f} GiB read from this machine",
        )
    return profile


def get_device(device: str | DeviceProfile) -> DeviceProfile:
    """The profile for a name (``"h100"``, ``"tpu-v5e"``, ...), ``"auto"`` (the running device, see
    :func:`detect_device`), or a :class:`DeviceProfile` as is.

    Raises `ValueError` for an unknown name, listing the known ones.
    """
    if isinstance(device, DeviceProfile):
        return device
    if not isinstance(device, str):
        raise TypeError(f"device must be a profile name or a DeviceProfile, got {type(device).__name__}")
    if device.strip().lower() == "auto":
        return detect_device()
    key = device.strip().lower().replace("_", "-")
    key = ALIASES.get(key, key)
    if key not in DEVICES:
        raise ValueError(
            f"unknown device profile {device!r}; known profiles: {sorted(DEVICES)} or 'auto' "
            f"(aliases {sorted(ALIASES)}), or pass transforms.custom_device(memory_gb=..., link_gb_s=..., tflops=...)"
        )
    return DEVICES[key]


def pinned_host_limit_bytes(environ=None) -> tuple[int, bool]:
    """(limit, set_explicitly): the XLA GPU client's pinned-host pool limit, from the environment."""
    environ = os.environ if environ is None else environ
    raw = environ.get(PINNED_HOST_LIMIT_VAR)
    if raw is None or not raw.strip():
        return PINNED_HOST_LIMIT_DEFAULT_GIB * GiB, False
    try:
        value = float(raw)
    except ValueError as err:
        raise ValueError(f"{PINNED_HOST_LIMIT_VAR}={raw!r} is not a number of GiB") from err
    return int(value * GiB), True


def device_memory_fraction(environ=None) -> tuple[float, bool]:
    """(fraction, set_explicitly): the share of device memory JAX preallocates for XLA."""
    environ = os.environ if environ is None else environ
    for var in MEM_FRACTION_VARS:
        raw = environ.get(var)
        if raw is not None and raw.strip():
            try:
                value = float(raw)
            except ValueError as err:
                raise ValueError(f"{var}={raw!r} is not a fraction") from err
            if not 0 < value <= 1:
                raise ValueError(f"{var}={raw!r} must be in (0, 1]")
            return value, True
    return MEM_FRACTION_DEFAULT, False
