"""The wrappers' benchmark: each trainer's ratio is against its peer, and its arguments are checked before any
rank starts."""

from __future__ import annotations

import pytest

from benchmarks import fsdp as bench
from shardwise.cli.main import main as cli_main


def test_each_trainer_is_compared_with_its_peer() -> None:
    times = {"shardwise fully_shard": [[0.010, 0.012], [0.011, 0.011]],     # median 0.011
             "torch fully_shard": [[0.022, 0.022], [0.022, 0.022]],         # 0.022
             "shardwise DDP": [[0.030, 0.030], [0.030, 0.030]],
             "torch DDP": [[0.015, 0.015], [0.015, 0.015]]}
    memory = {name: {"params": 10, "grads": 10, "optimizer": 20} for name in times}
    rows = {r.trainer: r for r in bench.summarize(times, memory, tokens_per_step=1100)}
    assert rows["shardwise fully_shard"].peer == "torch fully_shard"
    assert rows["shardwise fully_shard"].shardwise_ratio == pytest.approx(0.5)      # this / peer
    assert rows["torch fully_shard"].shardwise_ratio == pytest.approx(2.0)
    assert rows["shardwise DDP"].shardwise_ratio == pytest.approx(2.0)
    assert rows["shardwise fully_shard"].tokens_per_s == pytest.approx(1100 / 0.011)
    assert rows["torch DDP"].model_states_bytes == 40


def test_cli_lists_fsdp_and_rejects_one_rank(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", "fsdp", "--help"]) == 0
    assert "--memory-only" in capsys.readouterr().out
    assert cli_main(["bench", "fsdp", "--nproc", "1"]) == 2
    assert "use --nproc 2 or more" in capsys.readouterr().err
    assert cli_main(["bench", "fsdp", "--nproc", "2", "--seq-len", "4096"]) == 2


def test_pairs_choose_what_is_built_and_summarized() -> None:
    assert bench.parse_args([]).pairs == ["fsdp", "ddp"]
    assert bench.parse_args(["--pairs", "ddp"]).pairs == ["ddp"]
    times = {"shardwise DDP": [[0.030]], "shardwise DDP gloo": [[0.012]], "torch DDP": [[0.015]]}
    rows = bench.summarize(times, {n: {"params": 1, "grads": 1, "optimizer": 1} for n in times}, tokens_per_step=1)
    assert [r.trainer for r in rows] == ["shardwise DDP", "shardwise DDP gloo", "torch DDP"]
    # both of ours against torch's; torch's against the default wrapper
    assert [r.peer for r in rows] == ["torch DDP", "torch DDP", "shardwise DDP"]
    assert rows[1].shardwise_ratio == pytest.approx(0.8)
    with pytest.raises(SystemExit):
        bench.parse_args(["--pairs", "zero"])
