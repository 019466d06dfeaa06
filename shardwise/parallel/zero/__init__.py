"""ZeRO: optimizer states (stage 1), + gradients (stage 2), + parameters (stage 3) partitioned over the
data-parallel group."""
