"""Named models and clusters.

Models: the one preset table, `shardwise.models.presets` (torch-free): our GPT presets and the published shapes
(GPT-3, LLaMA), so that the planner sizes exactly the model `shardwise train --model NAME` builds.

Clusters: one DGX-style node per preset (8 GPUs, each with its own network port); `--gpus N` scales it.
Figures are the vendors' published ones: dense (no sparsity) peak matmul FLOP/s, HBM size and bandwidth,
NVLink and PCIe bandwidth halved to one direction, and one InfiniBand port per GPU.
"""

from __future__ import annotations

import difflib
from typing import Any

from shardwise.models.presets import MOE_PRESETS, PRESETS, GPTConfig

MODEL_PRESETS: dict[str, GPTConfig] = {**PRESETS, **MOE_PRESETS}
"""Every named model: the dense presets and the mixtures of experts (the planner counts experts)."""
from shardwise.planner.specs import ClusterSpec, PlannerError

_DGX_A100 = ("NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM: BF16 312 TFLOPS dense, FP32 19.5 TFLOPS, "
             "2,039 GB/s HBM2e, NVLink 600 GB/s, PCIe Gen4 64 GB/s, both bidirectional); DGX A100 user guide "
             "(8x 200 Gb/s HDR InfiniBand, 2 TB RAM, 2x EPYC 7742 with 8 DDR4-3200 channels each)")
_DGX_H100 = ("NVIDIA H100 Tensor Core GPU datasheet (H100 SXM: BF16 1,979 TFLOPS with sparsity = 989 dense, "
             "FP32 67 TFLOPS, 3.35 TB/s HBM3, NVLink 900 GB/s, PCIe Gen5 128 GB/s, both bidirectional); DGX H100 "
             "user guide (8x 400 Gb/s NDR InfiniBand, 2 TB RAM, 2x Xeon 8480C with 8 DDR5-4800 channels each)")
_DGX_H200 = ("NVIDIA H200 Tensor Core GPU datasheet (H200 SXM: 141 GB HBM3e at 4.8 TB/s, BF16 1,979 TFLOPS with "
             "sparsity = 989 dense, FP32 67 TFLOPS, NVLink 900 GB/s, PCIe Gen5 128 GB/s); DGX H200 "
             "(8x 400 Gb/s NDR InfiniBand, 2 TB RAM, same CPUs as DGX H100)")
_LATENCY_NOTE = "; latencies 5 us (NVLink) and 10 us (InfiniBand) per message are typical NCCL figures, assumed"
A100_GEMM_CEILING = 0.77
"""The large-GEMM ceiling (compute_efficiency) and ZeRO-3's share of the link (gather_efficiency), fitted on
half of the published A100 rows (Narayanan et al. 2021 Table 1: 1.7B, 7.5B, 39.1B, 145.6B, 529.6B; Table 2:
ZeRO-3 175B on 1,536 GPUs; Korthikanti et al. 2022 Table 5: 22B and 530B full, 175B and 1T selective) by
`python -m benchmarks.planner_published --fit`; the other rows check them."""
ZERO3_GATHER_SHARE = 0.81
_FITTED = "; GEMM ceiling 0.77 and ZeRO-3 link share 0.81 fitted on published A100 runs (Megatron papers)"
_FITTED_ELSEWHERE = "; GEMM ceiling and ZeRO-3 link share are the A100 fit (no published per-shape H100 rows used)"

CLUSTER_PRESETS: dict[str, ClusterSpec] = {
    "a100-80gb": ClusterSpec(
        name="a100-80gb", num_gpus=8, gpus_per_node=8, memory_bytes=80e9, peak_flops_bf16=312e12,
        peak_flops_fp32=19.5e12, intra_node_bw=300e9, inter_node_bw=25e9, memory_bw=2.039e12, pcie_bw=32e9,
        gemm_operand_bw=2.039e12,
        host_memory_bytes=2e12, host_memory_bw=2 * 204.8e9, compute_efficiency=A100_GEMM_CEILING,
        gather_efficiency=ZERO3_GATHER_SHARE, source=_DGX_A100 + _LATENCY_NOTE + _FITTED),
    "h100-80gb": ClusterSpec(
        name="h100-80gb", num_gpus=8, gpus_per_node=8, memory_bytes=80e9, peak_flops_bf16=989e12,
        peak_flops_fp32=67e12, intra_node_bw=450e9, inter_node_bw=50e9, memory_bw=3.35e12, pcie_bw=64e9,
        gemm_operand_bw=3.35e12,
        host_memory_bytes=2e12, host_memory_bw=2 * 307.2e9, compute_efficiency=A100_GEMM_CEILING,
        gather_efficiency=ZERO3_GATHER_SHARE, source=_DGX_H100 + _LATENCY_NOTE + _FITTED_ELSEWHERE),
    "h200": ClusterSpec(
        name="h200", num_gpus=8, gpus_per_node=8, memory_bytes=141e9, peak_flops_bf16=989e12,
        peak_flops_fp32=67e12, intra_node_bw=450e9, inter_node_bw=50e9, memory_bw=4.8e12, pcie_bw=64e9,
        gemm_operand_bw=4.8e12,
        host_memory_bytes=2e12, host_memory_bw=2 * 307.2e9, compute_efficiency=A100_GEMM_CEILING,
        gather_efficiency=ZERO3_GATHER_SHARE, source=_DGX_H200 + _LATENCY_NOTE + _FITTED_ELSEWHERE),
}


def _lookup(table: dict[str, Any], name: str, what: str) -> Any:
    key = name.strip().lower()
    if key in table:
        return table[key]
    close = difflib.get_close_matches(key, list(table), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise PlannerError(f"unknown {what} {name!r}: valid presets are {', '.join(table)}{hint}")


def model_preset(name: str) -> GPTConfig:
    return _lookup(MODEL_PRESETS, name, "model preset")


def model_name(model: GPTConfig) -> str:
    """What reports call `model`: its preset's name, or "custom"."""
    return next((name for name, preset in MODEL_PRESETS.items() if preset == model), "custom")


def cluster_preset(name: str, num_gpus: int | None = None) -> ClusterSpec:
    """The preset, optionally with `num_gpus` GPUs in total (whole nodes or less)."""
    cluster = _lookup(CLUSTER_PRESETS, name, "cluster preset")
    return cluster if num_gpus is None else cluster.replace(num_gpus=num_gpus)
