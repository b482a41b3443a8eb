"""The GPU classes and the issuing host the model prices, every figure with where it comes from.

Nothing here was measured on these machines' GPUs (there are none); each figure is a vendor's
sheet, a published measurement or a reading of this workplace's lent H200
(``/work/.library/device/KINDS.md``, 2026-11-04), and ``sources`` says which. A calibration file
(:mod:`dpqlab.timeline.calibration`) re-bases the ones a GPU run measured. Rates are what the
hardware *achieves* on the block's work (large bf16 GEMMs, flash attention, streaming elementwise
kernels); the sheet's peak is kept beside them, unused. Why it matters which: the work that divides
over lanes (matmuls, attention) is priced by these rates, so a rate set too low inflates it and
makes every speedup read optimistic, and one set too high does the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

__all__ = ["GPUS", "HOST", "GpuClass", "HostCosts"]


@dataclass(frozen=True)
class GpuClass:
    """One GPU and the links of the machine it sits in."""

    name: str
    matmul_flops: float  # achieved bf16 GEMM FLOP/s on a block's linear layers
    matmul_peak: float  # the sheet's dense bf16 tensor-core peak (reported, not used)
    attention_flops: float  # achieved FLOP/s of flash attention, forward and backward
    mem_bw: float  # achieved HBM/GDDR bandwidth of streaming kernels, B/s (bytes read + written)
    mem_peak: float  # the sheet's bandwidth (reported, not used)
    kernel_floor_s: float  # the shortest kernel, device side
    h2d: float  # pinned host <-> device copy, B/s
    d2d: float  # device-to-device copy between two GPUs, B/s
    link: float  # NCCL bus bandwidth per lane for reduce-scatter / all-gather, B/s
    link_latency_s: float  # per collective
    copy_latency_s: float = 10e-6
    peer_access: bool = True  # the GPUs reach each other directly (what dpq.planning.plan.overlap_choice asks)
    # the share of the device's SMs an NCCL kernel occupies while it runs (one block per channel): a
    # kernel beside it runs that much longer over the overlap (replay's Note [NCCL takes SMs])
    nccl_sm_share: float = 0.0
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    calibrated: str = ""  # the calibration that re-based it ("<card>-<date>"), "" = stated figures

    def rebased(self, **figures: float) -> GpuClass:
        return replace(self, **figures)


@dataclass(frozen=True)
class HostCosts:
    """The issuing host's time per thing it issues (a server CPU, CUDA torch)."""

    eager_op_s: float  # an eager aten op on CUDA: Python, dispatcher, autograd, cudaLaunchKernel
    view_op_s: float  # an op that only makes a view (slice, view, select): Python, dispatcher, no launch
    compiled_kernel_s: float  # one kernel of an inductor-compiled graph: its wrapper line + Triton's launcher
    compiled_extern_s: float  # an extern call (cuBLAS, flash attention) inside a compiled graph: an aten op
    region_call_s: float  # one call of a compiled graph, forward or backward: guards, AOT wrappers, the graph call
    graph_launch_s: float  # replaying a captured CUDA graph: cudaGraphLaunch from the host (Pricing.graphs)
    graph_tree_s: float  # torch.compile's CUDA graph trees (mode="reduce-overhead"): their checks per replay
    wait_s: float  # recording an event or making a stream wait for one
    nccl_call_s: float  # one call into NCCL inside a group (CuPy's binding, ncclSend/ncclRecv enqueueing)
    host_copy_bw: float  # host memcpy (pinning, host-side work on host memory), B/s
    compile_s: float  # compiling the block (forward + backward) for the first lane device, host seconds
    recompile_s: float  # for each further lane device or slice shape (dynamo guards on both): Triton's cache hits
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    calibrated: str = ""

    def rebased(self, **figures: float) -> HostCosts:
        return replace(self, **figures)


_KINDS = "this workplace's lent H200, /work/.library/device/KINDS.md (2026-11-04)"
_NVLINK = ("NVIDIA/nccl-tests#212 (S. Jeaugey, NCCL): 'NCCL can get an effective NVLink bandwidth of 370GB/s, which "
           "you can observe as BusBw when running non-allreduce operations' (8 x H100, NVLink 4)")
_FA2_H100 = ("FlashAttention-3 paper (Shah et al., 2024): FlashAttention-2 reaches ~35% of the H100's peak (~350 "
             "TFLOP/s); torch's flash SDPA backend is FlashAttention-2")

GPUS = {
    "3090": GpuClass(
        "RTX 3090 (PCIe 4.0 x16, no P2P)", matmul_flops=60e12, matmul_peak=71e12, attention_flops=39e12,
        mem_bw=800e9, mem_peak=936e9, kernel_floor_s=3e-6, h2d=24e9, d2d=10e9, link=10e9, link_latency_s=50e-6,
        peer_access=False, nccl_sm_share=2 / 82,
        sources={
            "matmul_peak": "NVIDIA Ampere GA102 whitepaper: 71 TFLOP/s dense BF16 with FP32 accumulate (RTX 3090)",
            "matmul_flops": "assumed 85% of the peak (cuBLAS on large GEMMs); no 3090 measurement at hand",
            "attention_flops": "assumed 55% of the peak (FlashAttention-2 on Ampere reaches 50-73% on A100, its "
                               "paper); no 3090 measurement at hand",
            "mem_peak": "NVIDIA RTX 3090 sheet: 936 GB/s GDDR6X",
            "mem_bw": "assumed 85% of the sheet's bandwidth for streaming kernels",
            "link": "NVIDIA/nccl-tests#74: PCIe 4.0 GPU pairs with P2P disabled move 19-21 GB/s bidirectional "
                    "(~10 GB/s each way); GeForce cards have no P2P, so NCCL stages through host memory",
            "h2d": "PCIe 4.0 x16: 31.5 GB/s per direction on paper, ~24 GB/s pinned in practice (assumed)",
            "d2d": "without P2P a copy between two GPUs is staged through the host: the link's ~10 GB/s",
            "peer_access": "GeForce cards have no P2P (the link's source): torch.cuda.can_device_access_peer is False",
            "link_latency_s": "assumed: NCCL over shared host memory, tens of microseconds per collective",
            "kernel_floor_s": "assumed: an empty kernel's device time is a few microseconds",
            "nccl_sm_share": "assumed: NCCL over host memory (no P2P) runs ~2 channels, one block each, of the "
                             "3090's 82 SMs",
        }),
    "h100": GpuClass(
        "H100 SXM (NVLink 4, NVSwitch)", matmul_flops=780e12, matmul_peak=989e12, attention_flops=350e12,
        mem_bw=2.9e12, mem_peak=3.35e12, kernel_floor_s=2.5e-6, h2d=50e9, d2d=370e9, link=370e9,
        link_latency_s=20e-6, nccl_sm_share=16 / 132,
        sources={
            "matmul_peak": "NVIDIA H100 SXM sheet: 989 TFLOP/s dense BF16",
            "matmul_flops": f"an 8192^3 bf16 torch.matmul ran at 769-798 TFLOP/s on {_KINDS}; the H200 is the same "
                            "GH100 chip at the same clocks (compute-bound work runs alike)",
            "attention_flops": _FA2_H100,
            "mem_peak": "NVIDIA H100 SXM sheet: 3.35 TB/s HBM3",
            "mem_bw": "assumed 87% of the sheet's bandwidth (the H200 reading below reached 90% of its own)",
            "link": _NVLINK, "d2d": _NVLINK,
            "h2d": "PCIe 5.0 x16: 63 GB/s per direction on paper, ~50 GB/s pinned in practice (assumed)",
            "link_latency_s": "assumed: NCCL's small-message latency over NVLink is ~10-20 microseconds",
            "nccl_sm_share": "assumed: NCCL on NVSwitch runs ~16 channels, one block (one SM) each, of the "
                             "H100's 132 SMs (NCCL_MAX_NCHANNELS / NCCL_MIN_NCHANNELS set it)",
            "kernel_floor_s": "assumed: an empty kernel's device time is a few microseconds",
        }),
}
# The H200: the H100's chip, clocks and links, with HBM3e
GPUS["h200"] = replace(
    GPUS["h100"], name="H200 SXM (NVLink 4, NVSwitch)", mem_bw=4.3e12, mem_peak=4.8e12,
    sources={**GPUS["h100"].sources,
             "matmul_peak": "NVIDIA H200 sheet: 989 TFLOP/s dense BF16",
             "matmul_flops": f"an 8192^3 bf16 torch.matmul ran at 769-798 TFLOP/s on {_KINDS}",
             "mem_peak": "NVIDIA H200 sheet: 4.8 TB/s HBM3e",
             "mem_bw": f"a device-to-device copy moved ~4.3 TB/s (bytes read + written) on {_KINDS}"})

_TRITONBENCH = ("meta-pytorch/tritonbench#1016/#1017 (GB200 host): an inductor kernel's launch (CachingAutotuner.run "
                "with Triton's binder and cuLaunchKernel) 6.8-9.1 us; a one-kernel compiled graph end to end "
                "(guards, DeviceGuard, CompiledFxGraph) 33-44 us")
_GRAPHS = ("pytorch/pytorch#150488 (B. Feng, 2025-04): one compiled graph replayed through CUDA graph trees, "
           "fullgraph, broken down per call")
HOST = HostCosts(
    eager_op_s=6.5e-6, view_op_s=1.0e-6, compiled_kernel_s=8e-6, compiled_extern_s=6.5e-6, region_call_s=40e-6,
    graph_launch_s=41e-6, graph_tree_s=128e-6, wait_s=1.5e-6, nccl_call_s=3e-6,
    host_copy_bw=10e9, compile_s=60.0, recompile_s=15.0,
    sources={
        "eager_op_s": "published breakdowns of one eager CUDA op's CPU path (Python ~1 us, binding ~1 us, autograd "
                      "1-3 us, ATen dispatch 1-2 us, cudaLaunchKernel 1-3 us: ~5-8 us on a server CPU; e.g. "
                      "jiahuanglin.xyz 'From PyTorch op to kernel launch'); the CPU-measured figure of "
                      "benchmarks/timeline.py is reported beside it as an upper bound",
        "view_op_s": "the H200 lease's world-2 trace (benchmarks/calibration/NVIDIA_H200-2026-12-04"
                     ".trace_world2.json.gz): on dpq's issuing thread the median view op (slice, view, "
                     "select, unbind) took 3.3 us against 21.2 us for the other aten ops (profiled; 1308 and "
                     "770 ops): 0.16 x eager_op_s",
        "compiled_kernel_s": _TRITONBENCH,
        "compiled_extern_s": "an extern kernel of a compiled graph goes through aten like an eager op",
        "region_call_s": _TRITONBENCH + "; a block's graph guards on more inputs (assumed 40 us per call)",
        "graph_launch_s": _GRAPHS + ": cudaGraphLaunch 41 us",
        "graph_tree_s": _GRAPHS + ": the CUDA graph trees' runtime checks 128 us per replay (beside it, dynamo's "
                        "cache lookup 176 us, which region_call_s prices)",
        "wait_s": "assumed: cudaEventRecord / cudaStreamWaitEvent are ~1-2 us of host time",
        "nccl_call_s": "assumed: a CuPy NcclCommunicator method is a thin Cython call, and inside a group "
                       "ncclSend/ncclRecv only enqueue (the kernels launch at groupEnd, priced as one op per rank)",
        "host_copy_bw": "assumed: a single-threaded host memcpy",
        "compile_s": "assumed 60 s for a block's forward + backward (inductor + Triton on a server CPU); a GPU "
                     "check measures it",
        "recompile_s": "assumed 15 s: dynamo, AOT autograd and inductor's lowering again for another device or "
                       "shape; the Triton kernels' source is the same, so Triton's on-disk cache serves them",
    })
