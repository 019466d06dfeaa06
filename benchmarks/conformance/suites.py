"""Which of the peers' test files are run, and the hand-kept part of classifying their failures under shardwise.

The candidate files are the ones whose subject shardwise implements (the engine, config, ZeRO, checkpoints, lr
schedules, comm, pipelines, activation checkpointing, precision; torch's fully_shard, FSDP and DDP). Within them,
the run keeps the tests that pass with the peer itself on this machine; those are the denominator.

A failure under shardwise is classed:
  (a) gap: a public API users rely on behaves otherwise (the default),
  (b) internal: the test reaches into a peer module that is not public API (named),
  (c) deliberate: shardwise differs on purpose, as README documents.
(b) is found from the swap log (`swap.py`): a test that read a name from a peer module outside `PUBLIC_MODULES` and
the harness modules. The tables below hold what the log cannot tell: deliberate differences, and internals reached
in ways the log does not see (a subclass of a peer class, an attribute read off an object).
"""

from __future__ import annotations

DEEPSPEED_FILES = [
    "unit/runtime/test_ds_config_dict.py",
    "unit/runtime/test_ds_config_model.py",
    "unit/runtime/test_ds_initialize.py",
    "unit/runtime/test_lr_schedulers.py",
    "unit/runtime/test_no_sync_ctxt.py",
    "unit/runtime/test_multiple_models.py",
    "unit/runtime/test_runtime_utils.py",
    "unit/runtime/zero/test_zero_config.py",
    "unit/runtime/zero/test_zero_context.py",
    "unit/runtime/zero/test_zero_context_return.py",
    "unit/runtime/zero/test_zero_nesting_init.py",
    "unit/runtime/zero/test_zero_linear_direct_init.py",
    "unit/runtime/zero/test_zero_tensor_fragment.py",
    "unit/runtime/zero/test_zero_grad_clip.py",
    "unit/runtime/zero/test_ignore_unused_parameters.py",
    "unit/checkpoint/test_zero_optimizer.py",
    "unit/checkpoint/test_tag_validation.py",
    "unit/checkpoint/test_latest_checkpoint.py",
    "unit/checkpoint/test_lr_scheduler.py",
    "unit/checkpoint/test_other_optimizer.py",
    "unit/checkpoint/test_pipeline.py",
    "unit/checkpoint/test_universal_checkpoint.py",
    "unit/comm/test_dist.py",
    "unit/pipe/test_pipe_module.py",
    "unit/runtime/pipe/test_pipe.py",
    "unit/runtime/pipe/test_topology.py",
    "unit/runtime/activation_checkpointing/test_activation_checkpointing.py",
    "unit/runtime/half_precision/test_fp16.py",
    "unit/utils/test_partition_balanced.py",
    "unit/v1/zero/test_zero.py",            # the longest: last
]

# Modules of DeepSpeed's test harness and environment: reading them says nothing about what a test tests.
DEEPSPEED_HARNESS = (
    "deepspeed.accelerator",
    "deepspeed.ops.__compatible_ops__",     # which kernels this build compiled: a test's skip condition
    "deepspeed.git_version_info",
    "deepspeed.ops.op_builder",
    "deepspeed.utils.logging",
    "deepspeed.utils.logger",
)

# Peer modules that real scripts and integrations (Hugging Face, Lightning, accelerate) import by path: a test
# failing on one of these is a gap (a), not a test of internals. shardwise provides them under the same path.
DEEPSPEED_PUBLIC_MODULES = (
    "deepspeed.comm",
    "deepspeed.zero",
    "deepspeed.pipe",
    "deepspeed.utils",
    "deepspeed.ops.adam",
    "deepspeed.checkpointing",
    "deepspeed.runtime.zero.partition_parameters",
    "deepspeed.runtime.zero.config",
    "deepspeed.runtime.lr_schedules",
    "deepspeed.runtime.engine",
    "deepspeed.runtime.pipe",
    "deepspeed.runtime.activation_checkpointing.checkpointing",
    "deepspeed.utils.zero_to_fp32",
    "deepspeed.initialize",
    "deepspeed.init_distributed",
    "deepspeed.add_config_arguments",
)

# test-id substring -> reason shardwise differs on purpose (each documented in README).
DELIBERATE: dict[str, str] = {
    "test_ds_config_dict.py::TestNoModel::test":
        "initialize(model=None) is a one-line UserError (a ValueError), not a bare assert: README, errors",
}

# test-id substring -> why a failure is a gap although the test file also imports peer internals (a test file's
# imports are charged to each of its tests, so the log alone would class it (b)).
GAPS: dict[str, str] = {
    "test_ds_initialize.py::TestConfigOptimizer::test":
        'a config "Adam" builds torch\'s AdamW, not a `deepspeed.ops.adam.FusedAdam` instance',
    "test_ds_initialize.py::TestClientOptimizer::test[None]":
        'a config "Adam" builds torch\'s AdamW, not a `deepspeed.ops.adam.FusedAdam` instance',
}

# test-id substring -> the internal a test reaches that the swap log cannot see.
INTERNAL: dict[str, str] = {
    "::test_ddp_logging_data_cpu":
        "torch.nn.parallel.distributed: DDP's private logging hooks (_set_ddp_runtime_logging_sample_rate, "
        "_get_ddp_logging_data) read off the model",
}

# Paths under a pytorch checkout's test/. Only tests that run on CPU with gloo pass with torch here; those are
# the denominator. test_distributed_spawn.py runs torch.testing._internal.distributed.distributed_test (in the
# wheel) over gloo: its DDP tests are kept (`TORCH_SELECT`), its collectives' tests are not shardwise's subject.
TORCH_FILES = [
    "distributed/_composable/fsdp/test_fully_shard_training.py",
    "distributed/_composable/fsdp/test_fully_shard_frozen.py",
    "distributed/_composable/fsdp/test_fully_shard_autograd.py",
    "distributed/_composable/fsdp/test_fully_shard_state_dict.py",
    "distributed/fsdp/test_fsdp_core.py",
    "distributed/test_distributed_spawn.py",
]

# file -> regular expression a test's name must match to be run (files absent here run whole).
# test_ddp_native_mixed_precision_grad_as_bucket_view_set_grad_to_none is left out: on a CPU-only machine its run
# ends with the pytest process itself terminated (SIGTERM), taking the tests after it down too.
TORCH_SELECT: dict[str, str] = {
    "distributed/test_distributed_spawn.py":
        r"^(?!test_ddp_native_mixed_precision_grad_as_bucket_view_set_grad_to_none$)"
        r"(test_ddp|test_DistributedDataParallel)",
}
