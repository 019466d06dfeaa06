"""What parity tests compare against: the tiny GPT and token batches the tests share, a single-process reference
trainer, global batches dealt to dp ranks, assertions with the tolerances of docs/design.md ("Testing"), and the
FLOPs a profiler should count. Ranks import these too, so they live here rather than in a conftest."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from shardwise.models import GPT


def tiny_gpt(*, n_layer: int = 2, d_model: int = 32, n_head: int = 4, seq_len: int = 16, vocab_size: int = 256,
             dropout: float = 0.0, seed: int | None = 1234, **overrides: Any) -> GPT:
    """The "tiny" GPT preset shrunk to test size (2 layers, width 32, 4 heads, 16 tokens, byte vocabulary).
    `seed` seeds torch's global RNG right before the build, so equal arguments give equal weights; None
    draws from the RNG as it stands (a meta-device build, or a caller that seeded already). Other GPTConfig
    fields (positions, tie_embeddings, n_kv_head, ...) go through `overrides`."""
    from shardwise.models import GPT, gpt_config
    if seed is not None:
        torch.manual_seed(seed)
    return GPT(gpt_config("tiny", n_layer=n_layer, d_model=d_model, n_head=n_head, seq_len=seq_len,
                          vocab_size=vocab_size, dropout=dropout, **overrides))


def token_batches(count: int, rows: int, seq: int, *, seed: int, vocab: int = 256) -> list[torch.Tensor]:
    """`count` batches of random token ids, each [rows, seq], drawn in order from one generator."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (rows, seq), generator=g) for _ in range(count)]


def lm_pair(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows [b, s + 1] as a language-model micro-batch: inputs [b, s] and next-token labels [b, s]."""
    return rows[:, :-1], rows[:, 1:]


def micro_steps(batches: Iterable[torch.Tensor], *, grad_accum: int, dp_size: int = 1,
                dp_rank: int = 0) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per global batch [B, s + 1], the (inputs, labels) micro-batches rank `dp_rank` trains on; with the
    defaults (one rank), the single-process reference's steps for `reference_train`."""
    return [[lm_pair(m) for m in shard_global_batch(b, dp_size=dp_size, dp_rank=dp_rank, grad_accum=grad_accum)]
            for b in batches]


def state_copy(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of the module's state dict (the module keeps training; the copy does not move)."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def mean_over_ranks(value: float) -> float:
    """The mean of a per-rank float over the default group (e.g. the data-parallel mean of a loss)."""
    t = torch.tensor([float(value)])
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


# -- single-process reference -----------------------------------------------------------------------

def reference_train(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    steps: Iterable[Sequence[Any]], *, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
                    clip: float | None = None,
                    scheduler: Any = None) -> list[float]:
    """Plain torch training: for each step, the micro-batches' mean loss is backpropagated (each
    micro-batch's loss divided by their count, as DeepSpeed does), optionally clipped, then stepped.
    Returns the per-step mean loss."""
    losses = []
    for micro_batches in steps:
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for mb in micro_batches:
            loss = loss_fn(model, mb)
            (loss / len(micro_batches)).backward()
            total += float(loss.detach())
        if clip is not None and clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(total / len(micro_batches))
    return losses


def shard_global_batch(batch: torch.Tensor, *, dp_size: int, dp_rank: int, grad_accum: int) -> list[torch.Tensor]:
    """The micro-batches rank `dp_rank` sees of a global batch [B, ...], B = grad_accum * dp * micro:
    micro-step k of rank r is rows [(k * dp + r) * micro, ... + micro)."""
    micro = batch.shape[0] // (grad_accum * dp_size)
    if micro * grad_accum * dp_size != batch.shape[0]:
        raise ValueError(f"global batch {batch.shape[0]} != grad_accum {grad_accum} * dp {dp_size} * micro")
    return [batch[(k * dp_size + dp_rank) * micro:(k * dp_size + dp_rank + 1) * micro] for k in range(grad_accum)]


def assert_close_lists(actual: Sequence[float], expected: Sequence[float], *, rtol: float = 1e-5,
                       atol: float = 0.0, what: str = "values") -> None:
    a, e = torch.tensor(list(actual), dtype=torch.float64), torch.tensor(list(expected), dtype=torch.float64)
    torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}\n{a}\nvs\n{e}")


def assert_close_growing(actual: Sequence[float], expected: Sequence[float], *, rtol_per_step: float,
                         steps: Sequence[int], what: str = "values") -> None:
    """|actual[i] - expected[i]| <= steps[i] * rtol_per_step * |expected[i]|: a tolerance that grows with the
    number of steps (optimizer updates, say) behind each value, as rounding differences accumulate over them.
    A value with 0 steps behind it must be equal."""
    assert len(actual) == len(expected) == len(steps), (what, len(actual), len(expected), len(steps))
    for i, (a, e, n) in enumerate(zip(actual, expected, steps)):
        a, e = float(a), float(e)
        rtol = n * rtol_per_step
        assert abs(a - e) <= rtol * abs(e), (f"{what}: element {i} ({n} steps in): {a!r} vs {e!r}, relative "
                                             f"difference {abs(a - e) / abs(e):.1e} > {rtol:.1e}")


def assert_state_close(actual: dict, expected: dict, *, what: str, adam: bool = False, rtol: float = 1e-5,
                       atol: float = 1e-5) -> None:
    """Every tensor of a gathered state dict equals the reference's (same keys). With `adam`, the attention
    k_proj biases are skipped: their true gradient is exactly 0 (softmax is shift-invariant per query), and
    Adam's m / sqrt(v) turns the rounding noise of a different reduction order into +-lr steps
    (docs/design.md, tolerances)."""
    assert actual.keys() == expected.keys(), f"{what}: keys {sorted(actual.keys() ^ expected.keys())} differ"
    for k, v in expected.items():
        if adam and k.endswith("k_proj.bias"):
            continue
        torch.testing.assert_close(actual[k], v, rtol=rtol, atol=atol, msg=lambda m: f"{what} {k}: {m}")


# -- FLOP counts ---------------------------------------------------------------------------------------

def gpt_forward_flops(model: GPT, tokens: int) -> tuple[int, int]:
    """A GPT's forward FLOPs over `tokens` tokens as the flops profiler counts them, and their gap to the
    analytic count (`model.flops_per_token()` / 3, the forward share of training). The analytic count prices
    every norm and bias parameter (the 1-D ones) at 2 FLOPs per token; the profiler prices only matmuls and
    attention, so it counts exactly that much less."""
    analytic = model.flops_per_token() * tokens // 3
    elementwise = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    return analytic - 2 * elementwise * tokens, 2 * elementwise * tokens
