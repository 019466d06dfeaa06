"""Configs no run can use: every input of check-config / initialize ends in one ConfigError line naming the key,
never a traceback (binary, UTF-16, deep nesting, huge integers, nan/inf/negative settings)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.config import ConfigError, load_config_for_world
from shardwise.config.load import read_config

BASE = {"train_batch_size": 8}


def _refused(config, world: int = 1) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config_for_world(config, world_size=world)
    return info.value


def _deep(levels: int) -> dict:
    root: dict = {}
    node = root
    for _ in range(levels):
        node["a"] = {}
        node = node["a"]
    return root


@pytest.mark.parametrize("params, key, words", [
    ({"lr": float("nan")}, "optimizer.params.lr", "finite"),
    ({"lr": float("inf")}, "optimizer.params.lr", "finite"),
    ({"lr": -1e-3}, "optimizer.params.lr", ">= 0"),
    ({"betas": [0.9, 1.0]}, "optimizer.params.betas[1]", "[0, 1)"),
    ({"betas": [-0.1, 0.99]}, "optimizer.params.betas[0]", "[0, 1)"),
    ({"eps": 0}, "optimizer.params.eps", "> 0"),
    ({"weight_decay": float("nan")}, "optimizer.params.weight_decay", "finite"),
    ({"weight_decay": "NaN"}, "optimizer.params.weight_decay", "finite"),
    ({"weight_decay": -0.1}, "optimizer.params.weight_decay", ">= 0"),
])
def test_nonsense_optimizer_values_are_refused_naming_the_key(params, key, words) -> None:
    err = _refused({**BASE, "optimizer": {"type": "AdamW", "params": params}})
    assert err.key == key and words in str(err) and "\n" not in str(err), str(err)


@pytest.mark.parametrize("value, words", [("NaN", "finite"), ("Infinity", "finite"), (float("inf"), "finite"),
                                          (-1.0, ">= 0")])
def test_nonsense_warmup_max_lr_is_refused(value, words) -> None:
    err = _refused({**BASE, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": value}}})
    assert err.key == "scheduler.params.warmup_max_lr" and words in str(err), str(err)


def test_every_problem_is_one_line_and_sane_values_pass() -> None:
    err = _refused({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": -1, "eps": -1}},
                    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": float("nan")}}})
    assert [p.key for p in err.problems] == ["optimizer.params.lr", "optimizer.params.eps",
                                             "scheduler.params.warmup_min_lr"]
    load_config_for_world({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": 0, "betas": [0, 0.999]}}},
                          world_size=1)
    load_config_for_world({**BASE, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
                           "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.1}}}, world_size=1)


def test_dict_configs_of_no_json_shape_are_refused() -> None:
    assert "not a string" in str(_refused({**BASE, 1: 2}))
    assert "nested more than" in str(_refused({**BASE, "optimizer": {"type": "Adam", "params": _deep(5000)}}))
    err = _refused({"train_batch_size": 10 ** 5000})
    assert err.key == "train_batch_size" and "5001 digits" in str(err)
    assert "2**63" in str(_refused({**BASE, "zero_optimization": {"reduce_bucket_size": -(2 ** 64)}}))


def _files(tmp: Path) -> dict[str, Path]:
    files = {
        "binary": bytes(range(256)) * 8,
        "utf16": json.dumps(BASE).encode("utf-16"),                 # with its BOM, as Windows tools write it
        "utf32": json.dumps(BASE).encode("utf-32"),
        "deep": b"[" * 100_000 + b"]" * 100_000,
        "deep_objects": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
        "big_int": b'{"train_batch_size": ' + b"9" * 5000 + b"}",
        "inf_float": b'{"gradient_clipping": 1e999}',
        "list": b"[1, 2]",
        "string": b'"hello"',
    }
    out = {}
    for name, data in files.items():
        out[name] = tmp / f"{name}.json"
        out[name].write_bytes(data)
    return out


def test_files_of_any_content_give_one_config_error(tmp_path: Path) -> None:
    files = _files(tmp_path)
    expected = {"binary": "not UTF-8 text", "utf16": "UTF-16 text", "utf32": "UTF-32 text", "deep": "too deeply",
                "deep_objects": "too deeply", "big_int": "out of range", "inf_float": "out of range",
                "list": "JSON object", "string": "JSON object"}
    for name, path in files.items():
        with pytest.raises(ConfigError) as info:
            read_config(str(path))
        assert expected[name] in str(info.value) and "\n" not in str(info.value), (name, str(info.value))
    # A UTF-8 byte-order mark is read, as DeepSpeed's hjson reads it.
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps(BASE).encode())
    assert read_config(str(bom)) == BASE
    # base64 text of a deep config is no config: the path is then reported missing, in one line
    inline = base64.urlsafe_b64encode(b"[" * 100_000 + b"]" * 100_000).decode()
    with pytest.raises(ConfigError, match="cannot read config file"):
        read_config(inline)


def test_check_config_cli_exits_2_with_one_line_for_each_bad_file(tmp_path: Path) -> None:
    files = _files(tmp_path)
    for name in ("binary", "deep"):         # the others take the same path (read_config, above)
        proc = subprocess.run([sys.executable, "-m", "shardwise.cli.main", "check-config", str(files[name])],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (name, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("shardwise: error:"), (name, proc.stderr)
