"""`shardwise schedule`: action lists, simulated vs formula bubble, in-flight peaks, PNG, errors exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shardwise.cli.main import SUBCOMMANDS, main
from shardwise.cli import schedule as schedule_cli


def test_registered() -> None:
    assert schedule_cli in SUBCOMMANDS


def test_prints_lists_bubble_and_peaks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "--stages", "4", "--micro-batches", "8", "--schedule", "1f1b"]) == 0
    out = capsys.readouterr().out
    assert "stage 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7" in out
    assert "bubble fraction    27.27% simulated, 27.27% formula" in out   # 3/11
    assert "bubble ratio       37.50% simulated, 37.50% formula" in out   # 3/8
    assert "peak in flight     4 3 2 1 per stage, in micro-batches" in out
    assert "makespan           33 (no-bubble ideal 24)" in out             # (8 + 3) * (1 + 2)


def test_interleaved_json_and_picture(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "t.png"
    assert main(["schedule", "-p", "4", "-m", "8", "-s", "interleaved_1f1b", "-v", "2", "--costs", "1,1",
                 "--out", str(png), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["virtual_stages"] == 2 and report["out"] == str(png)
    assert report["bubble_ratio"] == pytest.approx(3 / 16) == report["bubble_ratio_formula"]
    assert report["bubble_fraction"] == pytest.approx(3 / 19)
    assert report["peak_in_flight"] == [11, 9, 7, 5]
    assert report["actions"][3][:6] == ["F0", "F1", "F2", "F3", "F0.1", "B0.1"]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_interleaved_defaults_to_two_chunks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "-p", "2", "-m", "4", "-s", "interleaved_1f1b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["virtual_stages"] == 2


def test_long_lists_are_summarised(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "-p", "2", "-m", "40", "-s", "gpipe"]) == 0
    assert "(80 actions per stage; --actions prints them)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["-p", "2", "-m", "4", "-s", "1f1b_interleaved"], "did you mean 'interleaved_1f1b'"),
    (["-p", "2", "-m", "0"], "micro-batches = 0"),
    (["-p", "0", "-m", "4"], "pipeline stages = 0"),
    (["-p", "2", "-m", "4", "-v", "2"], "virtual_stages = 2 needs schedule 'interleaved_1f1b'"),
    (["-p", "2", "-m", "4", "--costs", "1"], "--costs = '1': give the forward and backward time as F,B"),
    (["-p", "2", "-m", "4", "--costs", "1,x"], "--costs backward = 'x' is not a number"),
    (["-p", "2", "-m", "4", "--send-mode", "sync"], "--send-mode = 'sync' is unknown"),
    (["-p", "2", "-m", "4", "--send-mode", "blocking"], "deadlock with blocking sends"),
])
def test_errors_exit_2_with_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardwise: error: ") and message in err and err.count("\n") == 1


def test_schedule_does_not_import_torch() -> None:
    code = ("import sys; from shardwise.cli.main import main; "
            "assert main(['schedule', '-p', '2', '-m', '2']) == 0; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
