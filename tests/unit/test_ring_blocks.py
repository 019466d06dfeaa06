"""The attention of one ring block (`shardwise.parallel.context.blocks`): the fused kernels equal the plain fp32
matmuls (output, log-sum-exp, gradients), on causal diagonal blocks and full blocks of either shape, grouped-query
heads included; and blocks merged by their log-sum-exp, each backward handed the merged output and log-sum-exp,
equal attention over all keys at once (torch's SDPA with autograd)."""

from __future__ import annotations

import pytest
import torch

from shardwise.parallel.context.blocks import (
    CpuFlashBlocks, CudaEfficientBlocks, CudaFlashBlocks, PlainBlocks, block_kernel, expand_heads,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
HEADS = [(4, 4), (4, 2), (6, 1)]                      # (query heads, key/value heads): plain, grouped, one kv head
BLOCKS = [(16, 16, True), (16, 16, False), (8, 16, False), (16, 8, False)]   # (query rows, keys, causal diagonal)


def _tensors(heads: int, kv: int, m: int, n: int, device: str, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, heads, m, 8), (2, kv, n, 8), (2, kv, n, 8), (2, heads, m, 8)]
    return [torch.randn(*s, generator=g).to(device) for s in shapes]                 # q, k, v, dout


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads,kv", HEADS)
@pytest.mark.parametrize("m,n,causal", BLOCKS)
def test_fused_block_equals_plain(device: str, heads: int, kv: int, m: int, n: int, causal: bool) -> None:
    q, k, v, dout = _tensors(heads, kv, m, n, device, seed=heads * 100 + m + n)
    fused = block_kernel(q)
    assert not isinstance(fused, PlainBlocks)
    plain, scale = PlainBlocks(), 8 ** -0.5
    out, lse = fused.forward(q, k, v, scale, causal)
    ref_out, ref_lse = plain.forward(q, k, v, scale, causal)
    torch.testing.assert_close(out.float(), ref_out)
    torch.testing.assert_close(lse, ref_lse)
    # The backward reads only the (out, lse) it is handed: give both kernels the same, not the block's own.
    final_out, final_lse = ref_out * 0.5, ref_lse + 0.7
    grads = fused.backward(dout, q, k, v, final_out, final_lse, scale, causal)
    ref_grads = plain.backward(dout, q, k, v, final_out, final_lse, scale, causal)
    for name, mine, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert mine.shape == ref.shape, name
        torch.testing.assert_close(mine.float(), ref, msg=lambda msg: f"{name}: {msg}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", ["fused", "plain"])
@pytest.mark.parametrize("heads,kv", HEADS)
def test_merged_blocks_equal_whole_attention(device: str, kernel: str, heads: int, kv: int) -> None:
    """Causal attention of 16 queries over 32 keys cut in two blocks: keys 0-15 wholly visible, keys 16-31 the
    causal diagonal block of queries 16-31; queries are rows 16-31 of the sequence."""
    q, k, v, dout = _tensors(heads, kv, 16, 32, device, seed=heads + kv)
    blocks = block_kernel(q) if kernel == "fused" else PlainBlocks()
    scale = 8 ** -0.5
    parts = [(slice(0, 16), False), (slice(16, 32), True)]
    results = [blocks.forward(q, k[:, :, keys], v[:, :, keys], scale, causal) for keys, causal in parts]
    lse = torch.logaddexp(results[0][1], results[1][1])
    out = sum(o.float() * torch.exp(block_lse - lse).unsqueeze(-1) for o, block_lse in results)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for keys, causal in parts:
        dq_, dk_, dv_ = blocks.backward(dout, q, k[:, :, keys], v[:, :, keys], out, lse, scale, causal)
        dq += dq_
        dk[:, :, keys] += dk_
        dv[:, :, keys] += dv_
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    visible = torch.ones(16, 32, dtype=torch.bool, device=device).tril(16)          # query i sees keys <= 16 + i
    expected = torch.nn.functional.scaled_dot_product_attention(
        leaves[0], *(expand_heads(t, heads // kv) for t in leaves[1:]), attn_mask=visible)
    expected.backward(dout)
    torch.testing.assert_close(out, expected.detach())
    for name, mine, leaf in zip(("dq", "dk", "dv"), (dq, dk, dv), leaves):
        assert leaf.grad is not None
        torch.testing.assert_close(mine, leaf.grad, msg=lambda msg: f"{name}: {msg}")


def test_kernel_choice_on_cpu() -> None:
    """Fused for the dtypes the CPU kernel computes in fp32; plain for the rest (fp64 stays fp64)."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert isinstance(block_kernel(torch.zeros(1, 1, 2, 8, dtype=dtype)), CpuFlashBlocks)
    assert isinstance(block_kernel(torch.zeros(1, 1, 2, 8, dtype=torch.float64)), PlainBlocks)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernel_choice_on_cuda() -> None:
    flash_capable = torch.cuda.get_device_capability()[0] >= 8
    half = block_kernel(torch.zeros(1, 1, 2, 64, dtype=torch.bfloat16, device="cuda"))
    assert isinstance(half, CudaFlashBlocks if flash_capable else CudaEfficientBlocks)
    assert isinstance(block_kernel(torch.zeros(1, 1, 2, 64, device="cuda")), CudaEfficientBlocks)
    assert isinstance(block_kernel(torch.zeros(1, 1, 2, 12, device="cuda")), PlainBlocks)
