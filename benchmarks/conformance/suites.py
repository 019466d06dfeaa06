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
    "test_pipe_module.py::TestPipeModuleSequential::":
        'its config has "pipeline": {"activation_checkpoint_interval": 1}, refused (README, pipeline options); it '
        "fails before that on counting each rank's parameters: shardwise's PipelineModule keeps every stage's "
        "layers until initialize, where DeepSpeed's builds only its own (a gap behind the refusal)",
    "test_pipe_module.py::TestPipeModuleCheckpointInterval::":
        "PipelineModule(activation_checkpoint_interval=) and pipeline.activation_checkpoint_interval > 0 are refused "
        "(README, pipeline options); the test also reads PipelineModule's private _precompute_checkpointable_values",
    "test_zero_linear_direct_init.py::TestZero3LinearInitContextPersistence::"
    "test_direct_init_preserves_quantized_linear_wrapper":
        "weight_quantization with quantized_initialization is refused (README, blocks switched on)",
    "test_pipe.py::TestPipeDynamicShape::":
        "PipelineModule(topology=, dynamic_shape=True) is refused (README, pipeline options: give num_stages; "
        "activation shapes are agreed once)",
    "test_multiple_models.py::TestMultipleModels::test_bf16_optimizer":
        '"data_types": {"grad_accum_dtype": "fp32"} is refused (README, per-tensor dtypes)',
}
# test_multiple_models' fp32_grad_accum=True cases (the third id field) ask for the same refused data_types block.
DELIBERATE.update({
    f"test_multiple_models.py::TestMultipleModels::test_zero_optimizer[{overlap}-{contiguous}-True-{stage}-{shared}-"
    f"{models}]": '"data_types": {"grad_accum_dtype": "fp32"} is refused (README, per-tensor dtypes)'
    for overlap in (False, True) for contiguous in (False, True) for stage in (1, 2, 3) for shared in (False, True)
    for models in (1, 2, 3)})

# test-id substring -> why a failure is a gap, where the error line alone does not say (or the test file also
# imports peer internals: a test file's imports are charged to each of its tests, so the log alone would class it
# (b)).
GAPS: dict[str, str] = {
    "test_zero_nesting_init.py::TestShutdownInNestingInit::test_shutdown_in_nesting_init":
        "a model built in a zero.Init block nested in another is laid out when the outermost block ends (it may "
        "still become another model's child); DeepSpeed partitions each module as its constructor returns, so its "
        "parameters have ds_id when the inner block ends",
}

# test-id substring -> the internal a test reaches that the swap log cannot see.
INTERNAL: dict[str, str] = {
    "::test_ddp_logging_data_cpu":
        "torch.nn.parallel.distributed: DDP's private logging hooks (_set_ddp_runtime_logging_sample_rate, "
        "_get_ddp_logging_data) read off the model",
    "test_zero_linear_direct_init.py::":
        "deepspeed.runtime.zero.partition_parameters: InsertPostInitMethodToModuleSubClasses.linear_bk and "
        "zero3_linear_wrap, how DeepSpeed patches F.linear for memory_efficient_linear (the module's other names "
        "are public)",
    "test_activation_checkpointing.py::test_configure_with_contiguous_checkpointing_requires_num_checkpoints":
        "deepspeed.runtime.activation_checkpointing.checkpointing: configure()'s module globals "
        "(PARTITION_ACTIVATIONS, CONTIGUOUS_CHECKPOINTING, num_layers, ...), saved and restored around the call",
    "test_runtime_utils.py::TestCheckOverflow::":
        "deepspeed.runtime.utils.CheckOverflow, the fp16 optimizers' helper, over deepspeed.utils.groups' private "
        "_create_expert_and_data_parallel (both read through module objects imported at collection)",
    "test_runtime_utils.py::TestClipGradNorm::":
        "deepspeed.runtime.utils: clip_grad_norm_ and get_weight_norm, the engine's internal helpers, over "
        "DeepSpeed's own process-group state",
    "test_zero_grad_clip.py::TestZeroGradClip::":
        "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3 (imported at collection): the test checks the "
        "engine's optimizer is that class and calls its private _get_norm_groups()",
    "test_other_optimizer.py::TestOtherOptimizerCheckpoint::":
        "deepspeed.runtime.engine: DeepSpeedEngine._get_optimizer_ckpt_name(), a private method naming the file",
    "test_zero_context_return.py::TestReturnParam::test_ext_param_return":
        "deepspeed.runtime.zero: the module's _external_params, DeepSpeed's registry of parameters a forward "
        "returns or reaches outside the module",
}
# test_multiple_models' shared_loss=True cases (the fifth id field) call the engine's private _backward_epilogue()
# after their own loss.backward().
INTERNAL.update({
    f"test_multiple_models.py::TestMultipleModels::test_zero_optimizer[{overlap}-{contiguous}-False-{stage}-True-"
    f"{models}]": "deepspeed.runtime.engine: DeepSpeedEngine._backward_epilogue(), a private method, called after "
                  "the test's own loss.backward()"
    for overlap in (False, True) for contiguous in (False, True) for stage in (1, 2, 3) for models in (1, 2, 3)})

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
