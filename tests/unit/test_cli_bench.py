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


def test_bench_outside_a_checkout_says_how_to_get_one(capsys, monkeypatch, tmp_path):
    # An installed wheel has no benchmarks/ next to the package: the command names the fix in one line.
    monkeypatch.setattr("shardwise.cli.bench._repo_root", lambda: tmp_path)
    assert main(["bench", "dp", "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "clone of the repository" in err and "pip install -e '.[dev]'" in err
