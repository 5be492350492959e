"""Hardware specs: memory, bandwidth and dense FLOP/s, each with its source.

Used by the roofline (modules 1 and 3) and the capacity budget (module 4). GPU figures are
the vendor's datasheet numbers for dense bf16/fp16 tensor math (datasheets often print the
2:4-sparse figure, twice as large). Bandwidth "GB/s" is 10**9 bytes per second.

Memory comes three ways. The datasheet's "80 GB" is the capacity of the memory chips, and memory
chips come in powers of two: an H100's 80 GB is 80 GiB of HBM3 (5 stacks of 16 GiB), 85.9 x 10**9
bytes, so :attr:`HardwareSpec.memory_bytes` holds it in GiB and ``datasheet_memory`` the label as
printed. ``driver_memory_bytes`` is what the CUDA driver reports as the card's total
(``torch.cuda.mem_get_info()[1]``), a little less: the driver and firmware reserve some (an H100
reports 79.14 GiB, 84.98 x 10**9 bytes, still more than 80 x 10**9). ECC is why a GDDR card reports
much less: GDDR6 (T4, L4, A10G) keeps its check bits in the same memory, so with ECC on (the
data-centre default) nvidia-smi shows 15,360 MiB of a T4's 16 GiB, 1/16 less; HBM (A100, H100, H200)
keeps them beside the data, "without a bandwidth or capacity penalty" (NVIDIA Tesla V100 architecture
whitepaper, ECC memory resiliency, https://images.nvidia.com/content/volta-architecture/pdf/
volta-architecture-whitepaper.pdf; nvidia-smi's documentation: "If ECC is enabled the total
available memory is decreased by several percent", https://docs.nvidia.com/deploy/nvidia-smi/index.html).
vLLM multiplies the driver's total by ``gpu_memory_utilization`` (``vllm/v1/worker/gpu_worker.py``),
so every budget uses :attr:`HardwareSpec.total_memory`.
:func:`measure_runtime` makes a spec for the learner's own runtime from measurements.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

GB = 1e9
GiB = 2**30
TB = 1e12
TFLOPS = 1e12


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator (or CPU) as the roofline sees it.

    Attributes:
        name: short name, e.g. "H100-SXM".
        memory_bytes: device memory (bytes): the datasheet's capacity, which is in GiB (see the
            module docstring), or a CPU's physical memory.
        bandwidth: peak memory bandwidth (bytes/s).
        flops: peak dense bf16/fp16 throughput (FLOP/s), or fp32 for a measured CPU.
        source: where the numbers come from (a datasheet URL, or "measured ...").
        driver_memory_bytes: the total the CUDA driver reports (bytes), which vLLM budgets
            from; None where only the datasheet figure is known.
        driver_memory_source: where that figure comes from (a vLLM startup log).
        platform: the vLLM platform that serves on it: "cuda" or "cpu" (vLLM's CPU build).
        supports_bf16: whether it computes in bfloat16 (NVIDIA compute capability >= 8.0, x86 and
            aarch64 CPUs); vLLM serves a float32 checkpoint in bf16 where it does, else fp16.
        compute_capability: NVIDIA's (major, minor) compute capability, None for a CPU; vLLM picks
            attention backends by it (vllm/platforms/cuda.py).
        memory_label: the capacity as the datasheet prints it ("80 GB"); "" where there is none.
    """

    name: str
    memory_bytes: float
    bandwidth: float
    flops: float
    source: str
    driver_memory_bytes: float | None = None
    driver_memory_source: str = ""
    platform: str = "cuda"
    supports_bf16: bool = True
    compute_capability: tuple[int, int] | None = None
    memory_label: str = ""

    @property
    def datasheet_memory(self) -> str:
        """The capacity as the datasheet prints it ("80 GB", which means 80 GiB), else in GiB."""
        return self.memory_label or f"{self.memory_bytes / GiB:.0f} GiB"

    @property
    def total_memory(self) -> float:
        """Bytes vLLM sees as the card's total: the driver's figure, else the datasheet's."""
        return self.driver_memory_bytes if self.driver_memory_bytes is not None else self.memory_bytes

    @property
    def ridge_point(self) -> float:
        """Arithmetic intensity (FLOP/byte) above which work is compute-bound."""
        return self.flops / self.bandwidth


# vLLM prints the driver's total at startup: "the current vLLM instance can use total_gpu_memory
# (79.14GiB) x gpu_memory_utilization (0.90) = ..." (vllm/v1/worker/gpu_worker.py). The figures
# below are read from such public logs; they vary by a few hundredths of a GiB with the driver.
_LOG = "vLLM startup log 'total_gpu_memory ({gib}GiB)'"
_LOG_80GB = (
    _LOG.format(gib="79.14") + " for an 8B model on an 80 GB card (a public vLLM log of a version up to "
    "0.11: 71.22 GiB requested at 0.90, 54.93 GiB left for the KV cache; course.kv.vllm.REFERENCE_LOG); "
    "other public 80 GB logs read 79.11-79.25 GiB"
)
_A100_DATASHEET = (
    "NVIDIA A100 datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)

GPUS: dict[str, HardwareSpec] = {
    spec.name: spec
    for spec in [
        HardwareSpec(
            "T4",
            16 * GiB,
            320 * GB,
            65 * TFLOPS,
            "NVIDIA T4 datasheet (65 TFLOPS mixed-precision FP16; no bf16 tensor cores), "
            "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf"
            " (16 GB GDDR6, 320 GB/s)",
            14.74 * GiB,
            _LOG.format(gib="14.74") + " on a Colab T4, ECC on (other public T4 logs read 14.56-14.75 GiB)",
            supports_bf16=False,  # compute capability 7.5 (vllm/platforms/cuda.py, supported_dtypes)
        ),
        HardwareSpec(
            "L4",
            24 * GiB,
            300 * GB,
            121 * TFLOPS,
            "NVIDIA L4 product page (242 TFLOPS FP16/BF16 with sparsity, so 121 dense), "
            "https://www.nvidia.com/en-us/data-center/l4/ (specifications table: 24 GB GDDR6, 300 GB/s)",
            21.99 * GiB,
            "UNVERIFIED: public vLLM logs of 24 GB data-centre cards read total_gpu_memory 21.48-21.99 GiB; "
            "none names the L4; pass the figure your own log prints (course kv --gpu-memory-gib)",
        ),
        HardwareSpec(
            "A10G",
            24 * GiB,
            600 * GB,
            70 * TFLOPS,
            "NVIDIA A10G, the AWS G5 variant of the A10 (https://www.nvidia.com/en-us/data-center/products/a10-gpu/); "
            "NVIDIA publishes no A10G datasheet. 24 GB GDDR6 at 600 GB/s per "
            "https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/ ; the 70 TFLOPS dense FP16 "
            "tensor figure is UNVERIFIED (secondary reports; the A10 itself is rated 125)",
            21.99 * GiB,
            "UNVERIFIED: public vLLM logs of 24 GB data-centre cards read total_gpu_memory 21.48-21.99 GiB; "
            "none names the A10G; pass the figure your own log prints (course kv --gpu-memory-gib)",
        ),
        HardwareSpec(
            "A100-40GB",
            40 * GiB,
            1555 * GB,
            312 * TFLOPS,
            _A100_DATASHEET + " (A100 40GB SXM: HBM2, 1,555 GB/s; 312 TFLOPS BF16 dense, 624 with sparsity)",
            39.49 * GiB,
            _LOG.format(gib="39.49") + " on 40 GB A100s (other public logs read 39.39-39.56 GiB)",
        ),
        HardwareSpec(
            "A100-80GB",
            80 * GiB,
            2039 * GB,
            312 * TFLOPS,
            _A100_DATASHEET + " (A100 80GB SXM: HBM2e, 2,039 GB/s; 312 TFLOPS BF16 dense, 624 with sparsity)",
            79.14 * GiB,
            _LOG_80GB,
        ),
        HardwareSpec(
            "H100-SXM",
            80 * GiB,
            3.35 * TB,
            989 * TFLOPS,
            "NVIDIA H100 product page (1,979 TFLOPS BF16 with sparsity, so 989 dense), "
            "https://www.nvidia.com/en-us/data-center/h100/ (specifications table, H100 SXM: 80 GB, 3.35 TB/s)",
            79.14 * GiB,
            _LOG_80GB,
        ),
        HardwareSpec(
            "H200-SXM",
            141 * GiB,
            4.8 * TB,
            989 * TFLOPS,
            "NVIDIA H200 product page (same compute as H100 SXM, HBM3e), "
            "https://www.nvidia.com/en-us/data-center/h200/ (specifications table, H200 SXM: 141 GB, 4.8 TB/s, "
            "1,979 TFLOPS BF16 with sparsity)",
            139.81 * GiB,
            _LOG.format(gib="139.81") + " on a 141 GB H200",
        ),
    ]
}

# Compute capability per catalogue GPU, from NVIDIA's table https://developer.nvidia.com/cuda-gpus
_COMPUTE_CAPABILITY = {
    "T4": (7, 5), "L4": (8, 9), "A10G": (8, 6), "A100-40GB": (8, 0), "A100-80GB": (8, 0),
    "H100-SXM": (9, 0), "H200-SXM": (9, 0),
}  # fmt: skip
# The capacity as each datasheet above prints it ("GB" there means GiB: see the module docstring).
_MEMORY_LABEL = {
    "T4": "16 GB GDDR6", "L4": "24 GB GDDR6", "A10G": "24 GB GDDR6", "A100-40GB": "40 GB HBM2",
    "A100-80GB": "80 GB HBM2e", "H100-SXM": "80 GB HBM3", "H200-SXM": "141 GB HBM3e",
}  # fmt: skip
for _name, _capability in _COMPUTE_CAPABILITY.items():
    GPUS[_name] = replace(GPUS[_name], compute_capability=_capability, memory_label=_MEMORY_LABEL[_name])

# Other names people use for the catalogue GPUs.
ALIASES = {"H100": "H100-SXM", "H200": "H200-SXM", "A100-80G": "A100-80GB", "A100-40G": "A100-40GB"}


CPU_NAME = "CPU"


def vllm_cpu(memory_bytes: float | None = None) -> HardwareSpec:
    """This machine's CPU as vLLM's CPU build sees it: no datasheet roofs, its physical memory.

    vLLM's CPU build budgets the KV cache from ``VLLM_CPU_KVCACHE_SPACE`` (GiB) when it is set, not
    from a share of the memory (:mod:`course.kv.vllm`); the roofs are left unknown (measure them with
    :func:`measure_runtime`).
    """
    memory = _physical_memory_bytes() if memory_bytes is None else float(memory_bytes)
    return HardwareSpec(
        CPU_NAME,
        memory,
        float("nan"),
        float("nan"),
        "this machine's physical memory (os.sysconf)",
        platform="cpu",
    )


def gpu(name: str) -> HardwareSpec:
    """Look up a catalogue GPU by name (case-insensitive; "H100" means the SXM part; "CPU" is
    vLLM's CPU build on this machine, :func:`vllm_cpu`)."""
    if name.upper() == CPU_NAME:
        return vllm_cpu()
    wanted = ALIASES.get(name.upper(), name)
    for key, spec in GPUS.items():
        if key.lower() == wanted.lower():
            return spec
    raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")


@dataclass(frozen=True)
class MeasuredRoofs:
    """The two roofs of this runtime, measured, with the spread of their repeats.

    bandwidth: bytes/s of a streaming read far larger than the last-level cache (best of n).
    flops: FLOP/s of a square matmul in ``dtype`` (best of n).
    *_times: the timed repeats (s), for the noise check.
    """

    device: str
    name: str
    dtype: str
    bandwidth: float
    flops: float
    read_bytes: int
    matmul_n: int
    read_times: tuple[float, ...]
    matmul_times: tuple[float, ...]
    last_level_cache_bytes: int | None
    memory_bytes: float

    @property
    def ridge_point(self) -> float:
        """FLOP/byte where the two roofs meet."""
        return self.flops / self.bandwidth

    @property
    def source(self) -> str:
        llc = (
            f"{self.last_level_cache_bytes / 2**20:.0f} MiB last-level cache"
            if self.last_level_cache_bytes
            else "last-level cache size unknown"
        )
        return (
            f"measured on this runtime: best of {len(self.matmul_times)} {self.matmul_n}x{self.matmul_n} "
            f"{self.dtype} matmuls, best of {len(self.read_times)} streaming reads of "
            f"{self.read_bytes / 2**20:,.0f} MiB ({llc})"
        )

    def spec(self) -> HardwareSpec:
        return HardwareSpec(self.name, self.memory_bytes, self.bandwidth, self.flops, self.source)


def last_level_cache_bytes() -> int | None:
    """Size of the largest CPU cache (bytes) where the OS tells it (Linux sysfs, macOS sysctl)."""
    import glob
    import subprocess
    import sys

    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as f:
                text = f.read().strip().upper()
        except OSError:
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        if text and text[-1] in units and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    if not sizes and sys.platform == "darwin":
        for key in ("hw.l3cachesize", "hw.l2cachesize"):
            try:
                out = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=5).stdout
            except (OSError, subprocess.SubprocessError):
                continue
            if out.strip().isdigit() and int(out) > 0:
                sizes.append(int(out))
    return max(sizes) if sizes else None


def measure_roofs(device: str = "cpu", dtype=None, *, quick: bool = False, repeats: int = 5) -> MeasuredRoofs:
    """Measure this runtime's memory roof (streaming read) and compute roof (matmul in ``dtype``).

    Memory: ``x.sum()`` over an fp32 buffer of at least 4x the last-level cache (1 GiB at the
    least, 256 MiB in quick mode), counted as the bytes read: what a decode step does with the
    weights. A buffer that fit in the cache would measure the cache, not the memory. Compute: a
    square matmul, 2 n³ FLOPs, in the dtype the model runs (fp32 on a CPU unless told; bf16 or
    fp16 on a GPU). Best of ``repeats`` runs after a warm-up: the roofs are what this runtime
    can reach; the repeats are kept so a noise check can see how steady they were.
    """
    import torch

    on_gpu = device.startswith("cuda")
    if dtype is None:
        dtype = (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16) if on_gpu else torch.float32
    n = (4096 if on_gpu else 1024) if quick else (8192 if on_gpu else 2048)
    llc = None if on_gpu else last_level_cache_bytes()
    floor = (256 if quick else 1024) * 2**20
    read_bytes = max(floor, 4 * (llc or 0))
    if on_gpu:
        memory = float(torch.cuda.get_device_properties(0).total_memory)
        name = torch.cuda.get_device_name(0)
    else:
        memory = _physical_memory_bytes()
        name = f"this CPU ({torch.get_num_threads()} threads)"
        if memory == memory:  # not NaN: never take more than an eighth of the machine's memory
            read_bytes = min(read_bytes, int(memory // 8))

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    def timed(fn) -> tuple[float, ...]:
        fn()  # warm-up: allocation, kernel selection, page faults
        sync()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return tuple(times)

    factors = [torch.randn(n, n, device=device).to(dtype) for _ in range(2)]
    matmul_times = timed(lambda: factors[0] @ factors[1])
    factors.clear()  # free them before the large buffer is allocated
    buffers = [torch.ones(read_bytes // 4, device=device, dtype=torch.float32)]
    read_times = timed(lambda: buffers[0].sum())
    buffers.clear()
    return MeasuredRoofs(
        device=device,
        name=name,
        dtype=str(dtype).removeprefix("torch."),
        bandwidth=read_bytes / min(read_times),
        flops=2 * n**3 / min(matmul_times),
        read_bytes=read_bytes,
        matmul_n=n,
        read_times=read_times,
        matmul_times=matmul_times,
        last_level_cache_bytes=llc,
        memory_bytes=memory,
    )


def measure_runtime(device: str = "cpu", *, quick: bool = False, dtype=None) -> HardwareSpec:
    """This runtime as a :class:`HardwareSpec`: measured matmul FLOP/s and memory bandwidth.

    See :func:`measure_roofs` for what is measured (a streaming read far larger than the
    last-level cache, a matmul in ``dtype``) and for the repeats behind the figures.
    """
    return measure_roofs(device, dtype, quick=quick).spec()


def _physical_memory_bytes() -> float:
    import os

    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return float("nan")


# --- interconnects: what tensor- and pipeline-parallel GPUs talk over -------------------------------


@dataclass(frozen=True)
class Interconnect:
    """The link a GPU uses to exchange activations with its peers.

    Attributes:
        name: "NVLink 4", "PCIe Gen5 x16", "InfiniBand NDR" ...
        kind: "nvlink", "pcie" or "network" (between servers).
        bandwidth: bytes/s one GPU can send in one direction at the same time as it receives as much
            (the datasheets print the sum of both directions: half of it).
        latency: seconds one collective or transfer costs before its first byte moves (launch, the
            peers' handshake); NVIDIA's datasheets give none, see ``latency_source``.
        domain: most GPUs that share this link (NVLink: the GPUs of one server); a group larger than
            this needs the next link out.
        source: the vendor's document for the bandwidth.
        latency_source: where the latency comes from.
    """

    name: str
    kind: str
    bandwidth: float
    latency: float
    domain: int
    source: str
    latency_source: str


# Latency: no datasheet prints one. NCCL's and vLLM's small-message all-reduces on 8 NVLink GPUs take
# a few microseconds to tens of microseconds; the figures below are round ASSUMPTIONS in that range (a
# PCIe hop goes through the host bridge, a network hop through two NICs and a switch) and
# benchmarks/parallel_check.py shows how much the check moves with them.
_NVLINK_LATENCY = 8e-6
_PCIE_LATENCY = 20e-6
_NETWORK_LATENCY = 30e-6
_LATENCY_NOTE = (
    "ASSUMED: NVIDIA's datasheets give no latency; a round figure in the range of small-message all-reduce "
    "times reported for NCCL and vLLM's custom all-reduce (vllm/distributed/device_communicators/"
    "custom_all_reduce.py), sensitivity in benchmarks/parallel_check.py"
)
_H100_PAGE = "NVIDIA H100 product page, specifications table, https://www.nvidia.com/en-us/data-center/h100/"
_H200_PAGE = "NVIDIA H200 product page, specifications table, https://www.nvidia.com/en-us/data-center/h200/"
_DGX_H100 = (
    "NVIDIA DGX H100/H200 datasheet (8x ConnectX-7, 400 Gb/s InfiniBand NDR per GPU), "
    "https://resources.nvidia.com/en-us-dgx-systems/ai-enterprise-dgx"
)

INTERCONNECTS: dict[str, tuple[Interconnect, ...]] = {
    "T4": (
        Interconnect("PCIe Gen3 x16", "pcie", 16 * GB, _PCIE_LATENCY, 8,
                     "NVIDIA T4 datasheet: 'Interconnect bandwidth 32 GB/s' (PCIe Gen3 x16, both directions), "
                     "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf",
                     _LATENCY_NOTE),
    ),
    "L4": (
        Interconnect("PCIe Gen4 x16", "pcie", 32 * GB, _PCIE_LATENCY, 8,
                     "NVIDIA L4 datasheet: 'Interconnect PCIe Gen4 x16 64GB/s' (both directions), no NVLink, "
                     "https://www.nvidia.com/en-us/data-center/l4/", _LATENCY_NOTE),
    ),
    "A10G": (
        Interconnect("PCIe Gen4 x16", "pcie", 32 * GB, _PCIE_LATENCY, 8,
                     "NVIDIA A10 datasheet: 'Interconnect PCIe Gen4 64GB/s' (both directions); AWS G5 servers have "
                     "no NVLink, https://www.nvidia.com/en-us/data-center/products/a10-gpu/", _LATENCY_NOTE),
    ),
    "A100-40GB": (
        Interconnect("NVLink 3", "nvlink", 300 * GB, _NVLINK_LATENCY, 8,
                     _A100_DATASHEET + ": 'NVIDIA NVLink 600GB/s' (SXM, both directions)", _LATENCY_NOTE),
        Interconnect("PCIe Gen4 x16", "pcie", 32 * GB, _PCIE_LATENCY, 8,
                     _A100_DATASHEET + ": 'PCIe Gen4 64GB/s' (both directions)", _LATENCY_NOTE),
        Interconnect("InfiniBand HDR", "network", 25 * GB, _NETWORK_LATENCY, 1 << 16,
                     "NVIDIA DGX A100 datasheet (8x ConnectX-6, 200 Gb/s HDR InfiniBand per GPU), "
                     "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/nvidia-dgx-a100-datasheet.pdf",
                     _LATENCY_NOTE),
    ),
    "H100-SXM": (
        Interconnect("NVLink 4", "nvlink", 450 * GB, _NVLINK_LATENCY, 8,
                     _H100_PAGE + ": 'NVIDIA NVLink: 900GB/s' (SXM, both directions)", _LATENCY_NOTE),
        Interconnect("PCIe Gen5 x16", "pcie", 64 * GB, _PCIE_LATENCY, 8,
                     _H100_PAGE + ": 'PCIe Gen5: 128GB/s' (both directions)", _LATENCY_NOTE),
        Interconnect("InfiniBand NDR", "network", 50 * GB, _NETWORK_LATENCY, 1 << 16, _DGX_H100, _LATENCY_NOTE),
    ),
    "H200-SXM": (
        Interconnect("NVLink 4", "nvlink", 450 * GB, _NVLINK_LATENCY, 8,
                     _H200_PAGE + ": 'NVIDIA NVLink: 900GB/s' (SXM, both directions)", _LATENCY_NOTE),
        Interconnect("PCIe Gen5 x16", "pcie", 64 * GB, _PCIE_LATENCY, 8,
                     _H200_PAGE + ": 'PCIe Gen5: 128GB/s' (both directions)", _LATENCY_NOTE),
        Interconnect("InfiniBand NDR", "network", 50 * GB, _NETWORK_LATENCY, 1 << 16, _DGX_H100, _LATENCY_NOTE),
    ),
}  # fmt: skip
INTERCONNECTS["A100-80GB"] = INTERCONNECTS["A100-40GB"]  # the same SXM4 board and DGX A100 network
INTERCONNECT_KINDS = ("nvlink", "pcie", "network")


def interconnect(device: str | HardwareSpec, kind: str | None = None, gpus: int = 2) -> Interconnect:
    """The link ``gpus`` GPUs of this kind talk over.

    ``kind`` None picks the fastest link whose domain holds ``gpus`` GPUs (NVLink inside a server of
    8 SXM GPUs, the network beyond); "nvlink", "pcie" or "network" asks for one (a PCIe-only server,
    or pipeline stages placed on different servers).
    """
    name = device.name if isinstance(device, HardwareSpec) else gpu(device).name
    links = INTERCONNECTS.get(name)
    if not links:
        raise ValueError(f"no interconnect is catalogued for {name}; known: {', '.join(INTERCONNECTS)}")
    if kind is not None:
        if kind not in INTERCONNECT_KINDS:
            raise ValueError(f"interconnect kind must be one of {', '.join(INTERCONNECT_KINDS)}, got {kind!r}")
        chosen = [link for link in links if link.kind == kind]
        if not chosen:
            raise ValueError(f"{name} has no {kind} link; it has {', '.join(link.name for link in links)}")
        return chosen[0]
    fitting = [link for link in links if link.domain >= gpus]
    if not fitting:
        raise ValueError(f"no link of {name} joins {gpus} GPUs")
    return max(fitting, key=lambda link: link.bandwidth)
