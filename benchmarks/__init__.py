"""Side-by-side benchmarks against the peers (DDP, DeepSpeed, FSDP2, DTensor, torch.distributed.pipelining) and
the planner-vs-engine harness. They live at the repository root, outside the installed package, because they
import dev-only peers: run them from a clone installed with `pip install -e '.[dev]'`.

Most modules are entry points for torch's elastic launcher (`python -m torch.distributed.run --nproc-per-node 2
-m benchmarks.<name>`, from the repository root) and offer `launch(nproc, argv)` for the `shardwise bench`
command. Comparisons alternate A and B after a warm-up and report medians and ratios: these machines are noisy.
"""
