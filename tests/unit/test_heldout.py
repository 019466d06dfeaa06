"""The held-out split and its evaluation windows, the summary's eval figures, and sampling."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from shardwise.data import CorpusError, TokenLoader
from shardwise.data.heldout import EvalWindows, split_held_out
from shardwise.telemetry import plot_loss_curve, read_metrics, summarize_run

TOKENS = np.arange(10_000, dtype=np.uint16)     # token i == position i


def test_split_is_positional_and_never_trained_on() -> None:
    train, held = split_held_out(TOKENS, 16)
    assert len(held) == 500 and len(train) + len(held) == len(TOKENS) and held[0] == train[-1] + 1
    loader = TokenLoader(train, seq_len=16, micro_batch=8, grad_accum=2, seed=3)
    for step in range(20):                      # every window (inputs and labels) lies before the split
        x, y = loader.global_batch(step)
        assert int(y.max()) < held[0]
    assert len(split_held_out(TOKENS[:100], 40)[1]) == 41            # at least one window
    with pytest.raises(CorpusError, match="too few to hold out 41"):
        split_held_out(TOKENS[:60], 40)


def test_eval_windows_are_fixed_disjoint_and_dealt_like_a_global_batch() -> None:
    _, held = split_held_out(TOKENS, 16)
    ranks = [EvalWindows(held, seq_len=16, micro_batch=2, dp_size=2, dp_rank=r) for r in range(2)]
    first = [[next(it) for _ in range(3)] for it in (w.batches() for w in ranks)]
    again = next(ranks[0].batches())
    assert torch.equal(again[0], first[0][0][0])                     # every evaluation starts over
    starts = sorted(int(x[i, 0]) for rank in first for x, _ in rank for i in range(2))
    assert starts == [int(held[0]) + 16 * k for k in range(12)]       # 12 consecutive windows, no overlap
    x, y = first[1][0]
    assert torch.equal(y[:, :-1], x[:, 1:]) and int(x[0, 0]) == int(held[0]) + 2 * 16   # rank 1 takes rows 2, 3
    wrap = EvalWindows(held[:33], seq_len=16, micro_batch=3)          # 2 windows: the third wraps to the first
    assert torch.equal(wrap.micro_batch_at(0)[0][2], wrap.micro_batch_at(0)[0][0])


def test_the_windows_an_evaluation_reads_are_the_first_ones_wrapping_around_at_any_layout() -> None:
    from shardwise.data.heldout import read_windows
    _, held = split_held_out(TOKENS, 16)
    few = held[:5 * 16 + 1]                                            # 5 windows
    for dp, micro, batches in ((1, 4, 3), (2, 3, 2), (3, 1, 4)):
        ranks = [EvalWindows(few, seq_len=16, micro_batch=micro, dp_size=dp, dp_rank=r) for r in range(dp)]
        starts = sorted(int(x[i, 0]) - int(few[0]) for w in ranks for k in range(batches)
                        for x in [w.micro_batch_at(k)[0]] for i in range(micro))
        count = ranks[0].windows_read(batches)
        assert count == dp * micro * batches
        assert starts == sorted(int(i) * 16 for i in read_windows(count, ranks[0].num_windows))


def test_summary_and_plot_carry_eval(tmp_path: Path) -> None:
    rows = [{"step": s, "loss": 5.0 - s / 10, "lr": 1e-3 * s, "tokens": 64, "tokens_per_s": 100.0, "mfu": 0.1,
             "step_time_s": 0.5, "elapsed_s": 0.5 * s, "rss_bytes": 1} for s in range(1, 7)]
    for r in rows[1::2]:
        r.update(eval_loss=r["loss"] + 0.5, eval_perplexity=math.exp(r["loss"] + 0.5), eval_windows=r["step"])
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = summarize_run(read_metrics(path), world_size=1, flops_per_token=1.0, peak_flops=1.0)
    assert summary.final_eval_loss == rows[-1]["eval_loss"]
    assert summary.final_eval_perplexity == pytest.approx(math.exp(summary.final_eval_loss))
    assert summary.final_eval_windows == 6                              # what the last evaluation averaged over
    assert plot_loss_curve(path, tmp_path / "loss.png").stat().st_size > 0
    rows[-1].pop("eval_loss")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert summarize_run(read_metrics(path), world_size=1, flops_per_token=1.0,
                         peak_flops=1.0).final_eval_loss == rows[3]["eval_loss"]


def test_sampling() -> None:
    from shardwise.models import GPT, gpt_config
    from shardwise.models.generate import generate
    torch.manual_seed(0)
    model = GPT(gpt_config("llama-tiny", n_layer=1, seq_len=8)).eval()
    prompt = torch.tensor([[1, 2, 3]])
    greedy = generate(model, prompt, max_new_tokens=10, context=8, temperature=0)
    with torch.no_grad():                       # greedy: each token the argmax of the last 8 tokens' logits
        for t in range(3, 13):
            assert int(greedy[0, t]) == int(model(greedy[:, max(0, t - 8):t])[0, -1].argmax())
    assert torch.equal(generate(model, prompt, max_new_tokens=10, context=8, top_k=1), greedy)
    a, b = (generate(model, prompt, max_new_tokens=10, context=8, temperature=1.5, top_k=5,
                     generator=torch.Generator().manual_seed(7)) for _ in range(2))
    assert torch.equal(a, b) and a.shape == (1, 13) and not torch.equal(a, greedy)


def test_eval_defaults_to_the_windows_the_run_averaged() -> None:
    from shardwise.cli.evaluate import RunEval, _windows_before_they_were_logged, window_indices

    # the run's evaluation read 12 windows of 5 held-out ones: 0..4, 0..4, 0, 1 (each read counts)
    chosen = window_indices(5, max_windows=None, logged=RunEval(step=4, loss=2.0, windows=12))
    assert chosen.of_run and chosen.indices.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    assert "at step 4" in chosen.described
    first = window_indices(5, max_windows=3, logged=RunEval(step=4, loss=2.0, windows=12))   # asked for
    assert not first.of_run and first.indices.tolist() == [0, 1, 2] and first.described == "the first 3 of 5 windows"
    assert window_indices(300, max_windows=None, logged=None).indices.tolist() == list(range(256))
    # metrics from before evaluations logged their windows: eval_batches * micro * dp from the step's global batch
    saved = {"eval_batches": 4, "seq_len": 32, "config": {"train_micro_batch_size_per_gpu": 8,
                                                          "gradient_accumulation_steps": 2}}
    assert _windows_before_they_were_logged({"tokens": 8 * 2 * 3 * 32}, saved) == 4 * 8 * 3      # dp 3
    unknown = {**saved, "config": {"train_batch_size": 48, "train_micro_batch_size_per_gpu": 8}}
    assert _windows_before_they_were_logged({"tokens": 48 * 32}, unknown) is None
