"""Benchmarks that run under torch's elastic launcher (`python -m torch.distributed.run`).

Each module is a runnable entry point (`python -m torch.distributed.run --nproc-per-node 2 -m
shardwise.benchmarks.<name>`) and offers `launch(nproc, argv)` for the `shardwise bench` command.
Comparisons alternate A and B after a warm-up and report medians and ratios: these machines are noisy.
"""
