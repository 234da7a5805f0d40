"""Devices the cost model runs on: named GPUs from vendor datasheets, overrides, measured rates.

Every number below is a parameter of `Hardware`, overridable by name from the CLI
(`chunkflow simulate --gpu h100 --gpu-set nvlink_gb_s=400 --gpu-set gemm_max_eff=0.7`), set by a
device profile, one per GPU and software stack, built in or written by `chunkflow calibrate`
(perfmodel/gpu_profiles.py, `--gpu-profile`), or built from measured rates for a CPU
(`hardware_from_measurements`). A bare `--gpu NAME` is the datasheet with the assumptions below,
not calibrated, and every printed figure says so.

Datasheet values (dense, i.e. without 2:4 sparsity; GB = 1e9 bytes; link rates per direction):

  name   peak bf16   HBM     HBM bw      NVLink/GPU     network/GPU        SMs
  h100   989 TFLOP/s 80 GB   3350 GB/s   450 GB/s       50 GB/s (400 Gb/s) 132
  h200   989 TFLOP/s 141 GB  4800 GB/s   450 GB/s       50 GB/s (400 Gb/s) 132
  a100   312 TFLOP/s 80 GB   2039 GB/s   300 GB/s       25 GB/s (200 Gb/s) 108

Sources:
- H100 SXM: https://www.nvidia.com/en-us/data-center/h100/ (datasheet table: BF16 Tensor Core
  1,979 TFLOPS "with sparsity", i.e. 989.4 dense; 80 GB; 3.35 TB/s; NVLink 900 GB/s, which is
  both directions of 18 links, so 450 GB/s each way). SM count: "NVIDIA H100 Tensor Core GPU
  Architecture" whitepaper (H100 SXM5: 132 SMs; 989.4e12 = 132 SMs x 4096 FLOP/clk x 1.83 GHz).
- H200 SXM: https://www.nvidia.com/en-us/data-center/h200/ (BF16 1,979 TFLOPS with sparsity;
  141 GB HBM3e; 4.8 TB/s; NVLink 900 GB/s). Same GH100 compute as H100 SXM5.
- A100 80GB SXM: https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/
  nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (BF16 312 TFLOPS dense; 80 GB HBM2e;
  2,039 GB/s; NVLink 600 GB/s both directions). 108 SMs: "NVIDIA A100 Tensor Core GPU
  Architecture" whitepaper (312e12 = 108 x 2048 FLOP/clk x 1.41 GHz).
- Network: one NIC per GPU as in DGX systems. DGX H100/H200: 8x ConnectX-7 400 Gb/s
  (https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html); DGX A100:
  8x ConnectX-6 200 Gb/s HDR (https://docs.nvidia.com/dgx/dgxa100-user-guide/).

Assumptions that are not datasheet numbers (stated, overridable, replaced by a profile's
measured, published or fitted rates):
- gemm_max_eff: the fraction of peak the best large, tile-aligned bf16 GEMM sustains. The peak
  assumes the boost clock; under a sustained tensor-core load at the power limit the clock drops
  (H100 SXM: 700 W), and each tile pays a pipeline fill and epilogue. 0.75 on Hopper, 0.85 on
  A100 (which holds its clock closer to boost at 400 W).
- attn_fwd_eff / attn_bwd_eff: the same ceiling for the fused attention kernel at long sequence
  lengths (head dim 128, causal, bf16), before tile quantization (perfmodel/roofline.py). The kernel
  authors' best cases are higher (FlashAttention-3: 75% of H100 peak forward; FlashAttention-2:
  up to 73% of A100 forward); we assume 0.6 forward and 0.45 backward (the backward runs 5
  matmuls with more synchronisation) for the varlen kernels Megatron calls.
- mem_eff: fraction of HBM bandwidth a streaming kernel reaches (0.8).
- comm_eff: fraction of link bandwidth a NCCL ring reaches (0.8); latency per ring hop.
- memory_gib: the device memory PyTorch sees (torch.cuda.get_device_properties().total_memory).
  H200: 139.8 GiB, measured on this project's GPU run (torch 2.11 + CUDA 13); NVIDIA's "141 GB"
  and "80 GB" count GiB, the driver keeping the rest. H100 and A100 80 GB: 79.3 GiB, the H200's
  measured share of its datasheet memory applied (not measured on those cards).
- reserve_gib: memory a job uses outside PyTorch's allocator (the CUDA context, NCCL's buffers,
  library workspaces): 2 GiB, an assumption (the context alone is about 0.5 GiB on Hopper).
- fragmentation: what the caching allocator reserves beyond the allocated peak before a request
  finds no segment (PyTorch's native allocator, replayed on traced steps by memtrace/allocator.py:
  the smallest device memory in which a step never fails, over its allocated peak). 0.18: the
  largest the replay found (Qwen2.5-1.5B at 32K, stock Megatron with full recompute, whose
  layer-sized recompute buffers interleave with the logits; ChunkFlow's plans 2-6%). A plan
  fits when its modelled allocated peak x (1 + fragmentation) + reserve_gib fits in memory_gib.
- cp_overlap: the fraction of context parallelism's ring traffic hidden behind the attention
  compute, in [0, 1]: attention costs compute + transfer - cp_overlap * min(compute, transfer)
  (1: max of the two, perfect overlap; 0: their sum). Transformer Engine's ring attention
  (transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py,
  AttnFuncWithCPAndKVP2P, which Megatron's TEDotProductAttention calls under CP) posts step i+1's
  K/V send/receive before step i's attention kernel, so the transfer is meant to hide behind it;
  what the ideal misses is that NCCL's send/receive kernels hold SMs the attention kernel wants
  while they run, and that each step's output and log-sum-exp correction and the wait for the
  next step's K/V serialize. 0.8 (a fifth of the hideable transfer stays exposed) is an
  assumption, not a measurement: `chunkflow simulate` reports the speedups at 0 and 1 beside it.
- kernel_launch_us: the host time of one kernel launch, the pace at which eager PyTorch can feed
  the GPU: an op cannot run faster than its kernels can be launched (perfmodel/layer.py counts
  the kernels of a layer). 3.8 us: NVIDIA's "Getting Started with CUDA Graphs" (A. Gray, 2019,
  https://developer.nvidia.com/blog/cuda-graphs/) measures 3.8 us per kernel for back-to-back
  launches of a 2.9 us kernel in a stream (the launch path, not the kernel, setting the pace;
  9.6 us with a synchronization after each). It is the CUDA launch alone, so a lower bound for
  eager PyTorch, whose dispatcher and Python add to it (`--gpu-set kernel_launch_us=10` shows
  what that would cost). 0 for measured CPU devices, whose host time per op is `op_overhead_us`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

GB = 1e9
GIB = 2.0**30
CP_OVERLAP = 0.8  # assumption, stated in the module docstring; reported at 0 and 1 by simulate
KERNEL_LAUNCH_US = 3.8  # https://developer.nvidia.com/blog/cuda-graphs/ (module docstring)
SPECS = ("te", "local")  # Hardware.spec
IDENTITY = ("name", "profile", "calibrated")  # Hardware fields that say which device, not a rate


@dataclass(frozen=True)
class Hardware:
    """One device type and its links. Units: TFLOP/s, GB (1e9 bytes), GB/s per direction."""

    name: str
    peak_tflops: float
    """Dense peak of the compute dtype (bf16 on GPUs): the MFU denominator."""
    memory_gib: float
    """Device memory PyTorch sees, GiB (2^30 bytes)."""
    hbm_gb_s: float
    """Device memory bandwidth."""
    nvlink_gb_s: float
    """Per-GPU bandwidth to GPUs of the same node, one direction."""
    network_gb_s: float
    """Per-GPU bandwidth to other nodes, one direction."""
    gpus_per_node: int = 8
    """GPUs sharing the fast intra-node links."""
    host_gb_s: float = 50.0
    """Per-GPU bandwidth to pinned host memory, one direction, as a copy reaches it (PCIe):
    --chunkflow-reforward-attention offload's copies."""
    num_sms: int = 0
    """Streaming multiprocessors for wave quantization; 0 turns tile/wave quantization off (CPU)."""
    gemm_max_eff: float = 0.75
    """Fraction of peak a large tile-aligned GEMM sustains."""
    attn_fwd_eff: float = 0.6
    """Fraction of peak the attention forward kernel sustains on long sequences."""
    attn_bwd_eff: float = 0.45
    """Fraction of peak the attention backward kernel sustains on long sequences."""
    attn_block: int = 128
    """Query/key tile of the attention kernel (tile quantization per segment); 0 = off."""
    mem_eff: float = 0.8
    """Fraction of memory bandwidth streaming (elementwise, optimizer) kernels reach."""
    comm_eff: float = 0.8
    """Fraction of link bandwidth a ring collective or a send reaches."""
    nvlink_latency_us: float = 5.0
    """Latency per ring hop or point-to-point message inside a node."""
    network_latency_us: float = 10.0
    """Latency per ring hop or point-to-point message across nodes."""
    reserve_gib: float = 2.0
    """Device memory used outside PyTorch's allocator (CUDA context, NCCL, workspaces), GiB."""
    fragmentation: float = 0.18
    """The caching allocator's reserve beyond a step's allocated peak, as a fraction of it."""
    dtype_bytes: int = 2
    """Bytes per element of weights and activations: 2 for bf16 (GPUs), 4 for fp32 (CPU runs)."""
    op_overhead_us: float = 0.0
    """Host time of one forward or backward op of a pipeline stage beyond its kernels (Python,
    framework); 0 on GPUs, where kernel launches run ahead of the kernels; measured on CPUs."""
    cp_overlap: float = CP_OVERLAP
    """Fraction of CP's ring traffic hidden behind attention compute, in [0, 1] (see above)."""
    kernel_launch_us: float = KERNEL_LAUNCH_US
    """Host time per kernel launch: a layer's op takes at least its kernels x this (see above)."""
    fused_swiglu: bool = True
    """The build fuses Megatron's bias-SwiGLU (on GPUs, as Megatron-LM does; the kernels are
    compiled for CUDA, so CPU builds keep SwiGLU's inputs too: perfmodel/footprint.py Build)."""
    kv_repeat: bool = False
    """The attention kernel keeps K and V repeated to every query head (torch 2.10-2.12's
    varlen_attn has no grouped-query attention; flash-attn and torch >= 2.13's have)."""
    spec: str = "te"
    """The layer the build runs: "te", Transformer Engine's (norms fused into the linears, fused
    rotary and SwiGLU: a layer's kernels and elementwise bytes counted by hand, perfmodel/layer.py),
    or "local", megatron-core's local spec as `chunkflow train` builds it without Transformer
    Engine and Apex (counted from the traced step: perfmodel/kernels.py)."""
    profile: str = ""
    """The device profile the rates come from (perfmodel/gpu_profiles.py); "" for a bare
    datasheet device with the assumptions above."""
    calibrated: bool = False
    """Whether the profile's rates were set against measurements on that device."""

    @property
    def build(self):
        """What the training build keeps on this device (perfmodel/footprint.py Build), with the
        loss whole; a run's --chunkflow-loss-piece goes in with dataclasses.replace."""
        from megatron_chunkflow.perfmodel.footprint import Build

        return Build(fused_swiglu=bool(self.fused_swiglu), kv_repeat=bool(self.kv_repeat))

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in IDENTITY or f.name == "spec":
                continue
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"hardware {self.name}: {f.name} must be a finite number >= 0, "
                                 f"got {v}")
        for f in ("peak_tflops", "memory_gib", "hbm_gb_s", "nvlink_gb_s", "network_gb_s",
                  "host_gb_s", "gemm_max_eff", "attn_fwd_eff", "attn_bwd_eff", "mem_eff",
                  "comm_eff"):
            if not getattr(self, f) > 0:
                raise ValueError(f"hardware {self.name}: {f} must be > 0")
        for f in ("gemm_max_eff", "attn_fwd_eff", "attn_bwd_eff", "mem_eff", "comm_eff"):
            if getattr(self, f) > 1:
                raise ValueError(f"hardware {self.name}: {f} is a fraction of peak, got "
                                 f"{getattr(self, f)} > 1")
        if not 0 <= self.cp_overlap <= 1:
            raise ValueError(f"hardware {self.name}: cp_overlap is the hidden fraction of the CP "
                             f"ring traffic, in [0, 1], got {self.cp_overlap}")
        if not self.reserve_gib < self.memory_gib:
            raise ValueError(f"hardware {self.name}: reserve_gib {self.reserve_gib} leaves "
                             f"nothing of memory_gib {self.memory_gib}")
        if self.spec not in SPECS:
            raise ValueError(f"hardware {self.name}: spec must be one of {', '.join(SPECS)}, "
                             f"got {self.spec!r}")
        if self.dtype_bytes not in (2, 4):
            raise ValueError(f"hardware {self.name}: dtype_bytes must be 2 or 4")
        if self.gpus_per_node < 1:
            raise ValueError(f"hardware {self.name}: gpus_per_node must be >= 1")

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    @property
    def usable_bytes(self) -> float:
        """The allocated peak a plan may reach: device memory less the reserve, over the allocator's
    fragmentation."""
        return (self.memory_gib - self.reserve_gib) * GIB / (1.0 + self.fragmentation)

    def link(self, group_span: int) -> tuple[float, float]:
        """(bytes/s, latency s) of a group whose ranks lie `group_span` consecutive GPUs apart
        at most: inside a node when the span fits in one, else across the network."""
        if group_span <= self.gpus_per_node:
            return self.nvlink_gb_s * GB * self.comm_eff, self.nvlink_latency_us * 1e-6
        return self.network_gb_s * GB * self.comm_eff, self.network_latency_us * 1e-6


_HOPPER = dict(num_sms=132, gemm_max_eff=0.75, attn_fwd_eff=0.6, attn_bwd_eff=0.45)
GPUS = {
    "h100": Hardware("h100", 989.4, 79.3, 3350, 450, 50, **_HOPPER),
    "h200": Hardware("h200", 989.4, 139.8, 4800, 450, 50, **_HOPPER),
    "a100": Hardware("a100", 312.0, 79.3, 2039, 300, 25, host_gb_s=25.0, num_sms=108,
                     gemm_max_eff=0.85, attn_fwd_eff=0.6, attn_bwd_eff=0.45),
}


def get_gpu(name: str) -> Hardware:
    try:
        return GPUS[name]
    except KeyError:
        raise ValueError(f"--gpu {name!r} is not known; known: {', '.join(GPUS)}") from None


def with_overrides(hw: Hardware, assignments: list[str], flag: str = "--gpu-set") -> Hardware:
    """Apply KEY=VALUE assignments (field names of Hardware) to `hw`."""
    fields = {f.name: f for f in dataclasses.fields(Hardware) if f.name not in IDENTITY}
    changes = {}
    for a in assignments:
        key, sep, value = a.partition("=")
        key = key.strip()
        if not sep or key not in fields:
            raise ValueError(f"{flag} {a!r}: expected KEY=VALUE with KEY one of "
                             f"{', '.join(fields)}")
        kind = {"int": int, int: int, "bool": _flag, bool: _flag, "str": str,
                str: str}.get(fields[key].type, float)
        try:
            changes[key] = kind(value)
        except ValueError:
            what = "switch (1 or 0)" if kind is _flag else kind.__name__
            raise ValueError(f"{flag} {a!r}: {value!r} is not a valid {what}") from None
    return dataclasses.replace(hw, **changes) if changes else hw


def _flag(value: str) -> bool:
    """A switch's value: 1/0, true/false, yes/no."""
    text = value.strip().lower()
    if text in ("1", "true", "yes"):
        return True
    if text in ("0", "false", "no"):
        return False
    raise ValueError(value)


def hardware_from_measurements(gemm_flops: float, attn_fwd_flops: float, attn_bwd_flops: float,
                               memory_bytes: float, p2p_bytes_per_s: float,
                               p2p_latency_s: float = 50e-6, mem_bytes_per_s: float = 10e9,
                               dtype_bytes: int = 4, name: str = "cpu",
                               fragmentation: float = 0.0,
                               op_overhead_s: float = 0.0) -> Hardware:
    """A device described by measured rates (e.g. a CPU running `chunkflow bench`).

    The fastest of the three compute rates becomes the peak (usually the GEMM rate, so MFU is
    relative to the measured GEMM rate) and each rate an efficiency relative to it. Tile and
    wave quantization are off. All ranks count as one node linked at `p2p_bytes_per_s`. No
    kernel launch floor: the measured host time per op (`op_overhead_s`) stands for it.
    """
    rates = {"gemm_flops": gemm_flops, "attn_fwd_flops": attn_fwd_flops,
             "attn_bwd_flops": attn_bwd_flops, "memory_bytes": memory_bytes,
             "p2p_bytes_per_s": p2p_bytes_per_s, "mem_bytes_per_s": mem_bytes_per_s}
    for key, value in rates.items():
        if not value > 0:
            raise ValueError(f"{key} must be > 0, got {value}")
    peak = max(gemm_flops, attn_fwd_flops, attn_bwd_flops)
    return Hardware(
        name=name, peak_tflops=peak / 1e12, memory_gib=memory_bytes / GIB, reserve_gib=0.0,
        hbm_gb_s=mem_bytes_per_s / GB, nvlink_gb_s=p2p_bytes_per_s / GB,
        network_gb_s=p2p_bytes_per_s / GB, gpus_per_node=1 << 20,
        host_gb_s=mem_bytes_per_s / GB, num_sms=0,
        gemm_max_eff=gemm_flops / peak, attn_fwd_eff=attn_fwd_flops / peak,
        attn_bwd_eff=attn_bwd_flops / peak, attn_block=0, mem_eff=1.0,
        comm_eff=1.0, nvlink_latency_us=p2p_latency_s * 1e6,
        network_latency_us=p2p_latency_s * 1e6, fragmentation=fragmentation,
        dtype_bytes=dtype_bytes, op_overhead_us=op_overhead_s * 1e6, kernel_launch_us=0.0,
        fused_swiglu=False)
