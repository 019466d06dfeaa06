"""The planner: FLOPs, memory, communication, pipeline bubble and step time of a model (our `GPTConfig`: a preset,
a Hugging Face config.json, or any shape) on a cluster, and the search for the fastest parallel plan (`shardwise
plan` is its command-line face). Pure functions over frozen dataclasses; no torch (`probes.py` runs in a child).

    from shardwise import planner
    model = planner.model_preset("llama-7b")
    cluster = planner.cluster_preset("h100-80gb", num_gpus=16)
    job = planner.JobSpec(global_batch=512, tokens=1e12)
    a = planner.analyze(model, cluster, job)            # search, recommend, explain
    a.chosen.plan, a.chosen.time.total_s, a.chosen.memory.total
    planner.deepspeed_config(a.chosen.plan, job)        # a config for `shardwise train`
"""

from __future__ import annotations

import importlib
from typing import Any

# Re-exported so a Plan can be written with this package alone; it is the config's enum, not a copy.
from shardwise.config import PipelineSchedule
# The pipeline's closed-form bubble, the one the planner's step time and `shardwise schedule` use.
from shardwise.parallel.pipeline.schedules import bubble_fraction, bubble_ratio
from shardwise.planner.analysis import Analysis, analyze
from shardwise.planner.comm import (
    Axis, Collective, Link, Op, cp_collectives, dp_collectives, pp_collectives, ring_seconds, ring_send_bytes,
    step_collectives, tp_collectives, zero_paper_volume,
)
from shardwise.planner.export import deepspeed_config, write_config
from shardwise.planner.flops import (
    ParamCount, TrainingCost, flops_per_token, forward_flops, iteration_flops, narayanan_params,
    narayanan_train_seconds, param_count, params_per_rank, six_nd, training_cost,
)
from shardwise.planner.hf import model_from_hf_config
from shardwise.planner.memory import (
    MemoryBreakdown, ModelStates, activation_bytes, layer_activation_bytes, max_trainable_params,
    memory_per_rank, model_state_bytes, peak_in_flight,
)
from shardwise.planner.presets import CLUSTER_PRESETS, MODEL_PRESETS, cluster_preset, model_name, model_preset
from shardwise.planner.rule import Strategy, describe, rule_of_thumb, strategy_of
from shardwise.planner.search import Evaluation, Infeasible, Reason, SearchResult, evaluate, recommend, search
from shardwise.planner.specs import (
    ClusterSpec, JobSpec, Offload, Optimizer, Plan, PlannerError, Precision, Recompute, Zero3Gather,
)
from shardwise.planner.time import StepTime, hfu, mfu, pipeline_seconds, step_time

_LAZY = {"calibrate": "shardwise.planner.calibrate", "load_cluster": "shardwise.planner.calibrate",
         "save_cluster": "shardwise.planner.calibrate"}

__all__ = [
    "Analysis", "Axis", "CLUSTER_PRESETS", "ClusterSpec", "Collective", "Evaluation", "Infeasible", "JobSpec",
    "Link", "MODEL_PRESETS", "MemoryBreakdown", "ModelStates", "Offload", "Op", "Optimizer", "ParamCount",
    "PipelineSchedule", "Plan", "PlannerError", "Precision", "Reason", "Recompute", "SearchResult", "StepTime",
    "Strategy", "TrainingCost", "Zero3Gather", "activation_bytes", "analyze", "bubble_fraction", "bubble_ratio",
    "calibrate", "cluster_preset", "cp_collectives", "deepspeed_config", "describe", "dp_collectives", "evaluate",
    "flops_per_token", "forward_flops", "hfu", "iteration_flops", "layer_activation_bytes", "load_cluster",
    "max_trainable_params", "memory_per_rank", "mfu", "model_from_hf_config", "model_name", "model_preset", "model_state_bytes",
    "narayanan_params", "narayanan_train_seconds", "param_count", "params_per_rank", "peak_in_flight",
    "pipeline_seconds", "pp_collectives", "recommend", "ring_seconds", "ring_send_bytes", "rule_of_thumb",
    "save_cluster", "search", "six_nd", "step_collectives", "step_time", "strategy_of", "tp_collectives",
    "training_cost", "write_config", "zero_paper_volume",
]


def __getattr__(name: str) -> Any:
    # calibrate.py is needed only to measure or load a cluster, so it is not imported eagerly.
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shardwise.planner' has no attribute {name!r}")
