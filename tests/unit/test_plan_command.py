"""The line `shardwise plan --write-config` prints is a complete `shardwise train` command: the model and the
world as nodes x processes per node."""

from __future__ import annotations

from shardwise.cli.main import main


def test_run_it_line_is_a_complete_command(capsys, tmp_path) -> None:
    """The printed command names the model and splits the world into nodes x processes, as `train` takes it."""
    from shardwise.cli.main import build_parser
    from shardwise.cli.train import prepare
    config = tmp_path / "c.json"
    assert main(["plan", "--model", "gpt3-175b", "--gpus", "1024", "--global-batch", "1536",
                 "--write-config", str(config)]) == 0
    line = capsys.readouterr().out.replace("\n", "")
    assert f"`shardwise train {config} --model gpt3-175b --nnodes 128 --nproc 8 --node-rank R --master-addr ADDR`" \
        in line, line
    assert main(["plan", "--model", "llama-tiny", "--gpus", "2", "--global-batch", "8", "--seq-len", "64",
                 "--write-config", str(config)]) == 0
    command = capsys.readouterr().out.replace("\n", "").split("`")[1]
    assert command == f"shardwise train {config} --model llama-tiny --seq-len 64 --nproc 2"
    args = build_parser().parse_args([*command.split()[1:], "--steps", "1", "--out", str(tmp_path / "run")])
    worker_args, _ = prepare(args)       # the command validates as `train` would run it
    assert (worker_args.model, worker_args.seq_len) == ("llama-tiny", 64)
