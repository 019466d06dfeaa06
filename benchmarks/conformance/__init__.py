"""Conformance: the peers' own test suites (DeepSpeed's tests/unit, torch's FSDP and DDP tests) run against shardwise.

`make conformance DEEPSPEED_SRC=DIR TORCH_SRC=DIR` (see run.py). Not part of `make test`: the peers' test files are
read from their checkouts, never copied here.
"""
