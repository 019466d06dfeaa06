from shardwise.cli.main import main


def test_bench_user_errors_exit_2(capsys):
    assert main(["bench", "allreduce", "--nproc", "1"]) == 2
    assert "--nproc must be >= 2" in capsys.readouterr().err
    assert main(["bench", "allreduce", "--nproc", "two"]) == 2
    assert "whole number" in capsys.readouterr().err
    assert main(["bench", "allreduce", "--nproc", "2", "--sizes-mb", "-1"]) == 2


def test_bench_help_lists_module_options(capsys):
    assert main(["bench", "allreduce", "--help"]) == 0
    assert "--sizes-mb" in capsys.readouterr().out
