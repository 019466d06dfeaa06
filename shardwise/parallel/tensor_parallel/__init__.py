"""Megatron-style tensor parallelism: layers cut from full layers (`layers.py`), conjugate communication operators
(`mappings.py`), a vocabulary-parallel loss (`loss.py`), plans that apply them to any model (`plan.py`), the full
state dict gathered from or split into the slices (`state_dict.py`) and per-rank dropout streams (`random.py`).

    info = apply_tensor_parallel(model, tp_comm, {"blocks.*.attn.q_proj": "colwise", ...})   # in place

Nothing here knows a model: the plans of the built-in GPT and of Hugging Face models are in
`models/parallelize.py`. The gradient norm over TP slices is `parallel.grad_norm`'s.
"""

from shardwise.parallel.tensor_parallel.state_dict import gather_full_state_dict, load_full_state_dict
from shardwise.parallel.tensor_parallel.layers import (
    TP_DIM_ATTR, ColumnParallelLinear, RowParallelLinear, TensorParallelError, VocabParallelEmbedding,
    is_tensor_parallel_shard,
)
from shardwise.parallel.tensor_parallel.loss import VocabParallelLoss, vocab_parallel_cross_entropy
from shardwise.parallel.tensor_parallel.mappings import (
    copy_to_region, gather_from_last_dim, gather_from_sequence, reduce_from_region, reduce_scatter_to_sequence,
    scatter_to_last_dim, scatter_to_sequence, sum_grad_over_region,
)
from shardwise.parallel.tensor_parallel.plan import (
    Style, TensorParallelInfo, apply_tensor_parallel, own_plan, resolve_plan,
)

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "TP_DIM_ATTR", "TensorParallelError",
    "is_tensor_parallel_shard", "vocab_parallel_cross_entropy", "VocabParallelLoss",
    "copy_to_region", "reduce_from_region", "gather_from_sequence", "reduce_scatter_to_sequence",
    "scatter_to_sequence", "gather_from_last_dim", "scatter_to_last_dim", "sum_grad_over_region",
    "Style", "TensorParallelInfo", "apply_tensor_parallel", "own_plan", "resolve_plan",
    "gather_full_state_dict", "load_full_state_dict",
]
