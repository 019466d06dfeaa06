"""How each model family is parallelized: the plans live here, beside the models, so that `shardwise.parallel`
knows no model (its `apply_tensor_parallel` takes any plan).

    info = parallelize_model(model, tp_comm)   # the engine, on the whole model before the pipeline split

Also here: `HuggingFaceAttention`, how selective activation recomputation reaches Hugging Face attention cores,
which are functions looked up by name, not modules.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from torch import nn

from shardwise.comm.collectives import Comm
from shardwise.models.gpt import GPT
from shardwise.parallel.recompute import recompute_call
from shardwise.parallel.tensor_parallel.layers import TP_MESH_ATTR, TensorParallelError, not_divisible
from shardwise.parallel.tensor_parallel.loss import VocabParallelLoss
from shardwise.parallel.tensor_parallel.plan import (
    COLWISE_STYLES, Style, TensorParallelInfo, apply_tensor_parallel, own_plan, pattern_regex, resolve_plan,
)

# -- the built-in GPT ---------------------------------------------------------------------------------


def gpt_tp_plan(sequence_parallel: bool = False, *, learned_positions: bool = True,
                swiglu: bool = False) -> dict[str, Style]:
    """Megatron's layout for the built-in `GPT`. Per block, without sequence parallelism: the attention
    input enters the region once (all-reduce backward), q/k/v column-parallel (heads split), o_proj
    row-parallel (all-reduce forward); fc_in column-parallel (all-reduce backward), fc_out row-parallel
    (all-reduce forward). The token table is split by vocabulary, the lm-head by vocabulary columns (its
    logits stay sharded for the vocabulary-parallel loss).

    With sequence parallelism the residual stream between blocks is [b, s/t, h]: the norms run on
    sequence shards, each all-reduce becomes an all-gather entering a region and a reduce-scatter
    leaving it. Learned positions are added to the replicated token embeddings, which are then split
    (`sequence_scatter`); without them the embedding reduce-scatters directly (`vocab_sp`).

    Dropout: the attention probabilities of this rank's heads, and with sequence parallelism every dropout
    on sequence shards, draw from the TP rank's own random stream (`local_rng`); dropout on replicated
    activations draws from the default stream, identical on every TP rank (`random.py`).

    A SwiGLU MLP (Llama) has two column-parallel inputs, fc_gate and fc_in: the MLP becomes a region like the
    attention, so its input enters once (one all-reduce backward, or one all-gather under SP) for both."""
    blocks = "blocks.*"
    mlp = _swiglu_plan(blocks, sequence_parallel) if swiglu else {}
    if not sequence_parallel:
        return {
            "embed.tok": Style.VOCAB,
            f"{blocks}.attn": Style.REGION,
            f"{blocks}.attn.q_proj": Style.COLWISE,
            f"{blocks}.attn.k_proj": Style.COLWISE,
            f"{blocks}.attn.v_proj": Style.COLWISE,
            f"{blocks}.attn.o_proj": Style.ROWWISE,
            f"{blocks}.attn.core": Style.LOCAL_RNG,
            f"{blocks}.mlp.fc_in": Style.COLWISE,
            f"{blocks}.mlp.fc_out": Style.ROWWISE,
            "head.lm_head": Style.COLWISE,
            **mlp,
        }
    embedding = ({"embed.tok": Style.VOCAB, "embed": Style.SEQUENCE_SCATTER} if learned_positions
                 else {"embed.tok": Style.VOCAB_SP, "embed.drop": Style.LOCAL_RNG})
    return {
        **embedding,
        f"{blocks}.ln_1": Style.SEQUENCE_PARALLEL,
        f"{blocks}.attn": Style.REGION_SP,
        f"{blocks}.attn.q_proj": Style.COLWISE,
        f"{blocks}.attn.k_proj": Style.COLWISE,
        f"{blocks}.attn.v_proj": Style.COLWISE,
        f"{blocks}.attn.o_proj": Style.ROWWISE_SP,
        f"{blocks}.attn.core": Style.LOCAL_RNG,
        f"{blocks}.attn.resid_drop": Style.LOCAL_RNG,
        f"{blocks}.ln_2": Style.SEQUENCE_PARALLEL,
        f"{blocks}.mlp.fc_in": Style.COLWISE_SP,
        f"{blocks}.mlp.fc_out": Style.ROWWISE_SP,
        f"{blocks}.mlp.drop": Style.LOCAL_RNG,
        "head.norm": Style.SEQUENCE_PARALLEL,
        "head.lm_head": Style.COLWISE_SP,
        **mlp,
    }


def _swiglu_plan(blocks: str, sequence_parallel: bool) -> dict[str, Style]:
    """The SwiGLU MLP's entries (they override fc_in's): a region holding two column-parallel inputs."""
    return {f"{blocks}.mlp": Style.REGION_SP if sequence_parallel else Style.REGION,
            f"{blocks}.mlp.fc_gate": Style.COLWISE,
            f"{blocks}.mlp.fc_in": Style.COLWISE}


def _divisors(n: int, limit: int = 64) -> str:
    return ", ".join(str(d) for d in range(1, min(n, limit) + 1) if n % d == 0)


def _size_problems(sizes: Sequence[tuple[str, object, str]], tp: int) -> list[str]:
    """A problem for each size that is an int `tp` does not divide (a model may lack some: None)."""
    return [not_divisible(what, value, tp, f"{why}; use a tensor_parallel.size dividing {value} "
                                           f"({_divisors(value)}) or change the model")
            for what, value, why in sizes if isinstance(value, int) and value % tp]


def validate_gpt(cfg: Any, tp: int) -> list[str]:
    """Problems splitting a `GPTConfig` over `tp` ranks (empty: it splits)."""
    return _size_problems([
        ("n_head (attention heads)", cfg.n_head, "each rank computes whole attention heads"),
        ("n_kv_head (key/value heads)", cfg.n_kv_head, "each rank holds whole key/value heads"),
        ("d_model (hidden size)", cfg.d_model, "the attention output projection is split by hidden features"),
        ("d_ff (FFN size)", cfg.d_ff, "each rank holds d_ff / size MLP features"),
        ("vocab_size", cfg.vocab_size, "the embedding and the lm-head are split by vocabulary rows"),
    ], tp)


def _raise_if(problems: list[str], tp: int, what: str) -> None:
    if problems:
        raise TensorParallelError(f"tensor_parallel.size = {tp} cannot split {what}:\n  - " + "\n  - ".join(problems))


def parallelize_gpt(model: GPT, comm: Comm, *, sequence_parallel: bool = False) -> TensorParallelInfo:
    """Split a `GPT` in place with `gpt_tp_plan`, and make `model.loss` (hence
    `model(ids, labels)`) the vocabulary-parallel cross-entropy. `model(ids)` then returns this rank's
    vocabulary shard of the logits, [b, s, vocab / t]."""
    _raise_if(validate_gpt(model.cfg, comm.size), comm.size, "this GPT")
    plan = gpt_tp_plan(sequence_parallel, learned_positions=model.cfg.positions == "learned",
                       swiglu=model.cfg.mlp == "swiglu")
    info = apply_tensor_parallel(model, comm, plan)
    # Shadows the static GPT.loss on this instance only (an instance attribute the checker cannot follow).
    model.loss = VocabParallelLoss(comm)  # type: ignore[method-assign]
    return info


# -- Hugging Face models ------------------------------------------------------------------------------

HF_STYLES: dict[str, Style | None] = {
    "colwise": Style.COLWISE,
    "rowwise": Style.ROWWISE,                  # on an nn.Embedding: vocabulary split
    "colwise_rep": Style.COLWISE_REP,
    "colwise_gather_output": Style.COLWISE_REP,
    "rowwise_rep": Style.ROWWISE_REP,
    "rowwise_split_input": Style.ROWWISE_REP,
    "embedding_rowwise": Style.VOCAB,
    "replicated_with_grad_allreduce": Style.GRAD_ALLREDUCE,
    "replicate": None,                         # every rank keeps the full module: nothing to do
}
"""transformers' tensor-parallel style strings -> ours (None: leave the module whole)."""

HEAD_COUNT_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "hidden_size",
                    "all_head_size", "embed_dim")
"""Integer attributes of an attention module that count its heads or their total width; attention code
written before the `view(*shape, -1, head_dim)` idiom reshapes with them, so they become per-rank."""

_QKV_NAMES = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query", "key", "value")


def is_hf_model(model: nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "base_model_tp_plan", None))


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's tensor-parallel plan in transformers' strings, resolved as transformers does: the base
    model's `config.base_model_tp_plan` under its `base_model_prefix`, its `embed_tokens` split by vocabulary
    unless named, and the head module's class-level `_tp_plan` (e.g. {"lm_head": "colwise_gather_output"})."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, prefix, None) if prefix else None
    if not isinstance(base, nn.Module):
        base, prefix = model, ""
    dot = f"{prefix}." if prefix else ""
    plan: dict[str, str] = {}
    if isinstance(getattr(base, "embed_tokens", None), nn.Embedding):
        plan[f"{dot}embed_tokens"] = "embedding_rowwise"
    config: Any = model.config     # transformers' PretrainedConfig, read by attribute (transformers is optional)
    plan.update({f"{dot}{k}": v for k, v in (config.base_model_tp_plan or {}).items()})
    if base is not model:
        plan.update(getattr(type(model), "_tp_plan", None) or {})
    return plan


def translate_hf_plan(model: nn.Module, hf_plan: Mapping[str, str]) -> dict[str, Style]:
    """transformers' plan -> ours. Entries naming parameters, or styles we do not implement (MoE, packed,
    local, sequence_parallel), are errors; entries matching nothing are dropped, as transformers does."""
    params = [n for n, _ in model.named_parameters()]
    problems: list[str] = []
    plan: dict[str, Style] = {}
    for key, value in hf_plan.items():
        if value not in HF_STYLES:
            problems.append(f'"{key}": style "{value}" is not supported (supported: {", ".join(HF_STYLES)})')
            continue
        if any(pattern_regex(key).fullmatch(p) for p in params):
            problems.append(f'"{key}": plan entries that name a parameter rather than a module are not supported')
            continue
        style = HF_STYLES[value]
        if style is not None:
            plan[key] = style
    if problems:
        raise TensorParallelError(f"cannot use the tensor-parallel plan of {type(model).__name__}:\n  - "
                                  + "\n  - ".join(problems))
    return plan


def validate_hf(config: Any, tp: int) -> list[str]:
    kv = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
    return _size_problems([
        ("num_attention_heads", getattr(config, "num_attention_heads", None), "each rank computes whole heads"),
        ("num_key_value_heads", kv, "each rank holds whole key/value heads"),
        ("hidden_size", getattr(config, "hidden_size", None), "row-parallel layers split the hidden features"),
        ("intermediate_size (FFN)", getattr(config, "intermediate_size", None),
         "each rank holds intermediate_size / size MLP features"),
        ("vocab_size", getattr(config, "vocab_size", None), "the embedding and lm-head are split by vocabulary"),
    ], tp)


def _adjust_head_counts(model: nn.Module, styles: Mapping[str, Style], tp: int) -> None:
    adjusted: set[str] = set()
    for name, style in styles.items():
        parent, _, leaf = name.rpartition(".")
        if style not in COLWISE_STYLES or leaf not in _QKV_NAMES or parent in adjusted:
            continue
        adjusted.add(parent)
        attention = model.get_submodule(parent)
        for attr in HEAD_COUNT_ATTRS:
            value = getattr(attention, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(attention, attr, value // tp)


def parallelize_hf(model: nn.Module, comm: Comm) -> TensorParallelInfo:
    """Split a transformers model in place from its own plan (see `hf_tp_plan`); attention modules' head
    counts become per-rank. Needs `transformers` only to build the model, not here."""
    tp = comm.size
    _raise_if(validate_hf(model.config, tp), tp, type(model).__name__)
    plan = translate_hf_plan(model, hf_tp_plan(model))
    styles = resolve_plan((n for n, _ in model.named_modules()), plan, strict=False)
    info = apply_tensor_parallel(model, comm, styles, strict=True)
    _adjust_head_counts(model, styles, tp)
    return info


# -- Hugging Face attention under selective recomputation -----------------------------------------------

_RECOMPUTED_PREFIX = "shardwise-recompute:"


def _hf_attention_configs(blocks: list[nn.Module]) -> list[Any]:
    """The distinct configs of the Hugging Face attention layers among `blocks` (they look their attention
    function up by `config._attn_implementation`)."""
    found = {}
    for b in blocks:
        for m in b.modules():
            config = getattr(m, "config", None)
            if type(m).__name__.endswith("Attention") and hasattr(config, "_attn_implementation"):
                found[id(config)] = config
    return list(found.values())


def recompute_hf_attention(config: Any) -> None:
    """Selective recomputation for Hugging Face models: their attention core (the function
    `config._attn_implementation` names: sdpa, eager, flex...) is registered again under a name of ours that runs
    it under torch's checkpoint, with the mask function of the same core, and the config points at it. q, k, v
    [b, a, s, d] are kept (and counted); the core's own saved tensors (the scores and probabilities under eager
    attention) are dropped and recomputed."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
    inner = config._attn_implementation or "eager"
    if inner.startswith(_RECOMPUTED_PREFIX):
        return
    name = _RECOMPUTED_PREFIX + inner

    def core(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if inner == "eager" or inner not in ALL_ATTENTION_FUNCTIONS:
            import sys
            function = getattr(sys.modules[type(module).__module__], "eager_attention_forward")
        else:
            function = ALL_ATTENTION_FUNCTIONS[inner]
        return recompute_call(function, module, *args, **kwargs)

    AttentionInterface.register(name, core)
    # The causal mask is built by the implementation's name too: ours takes the mask its core takes.
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    if inner in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    config._attn_implementation = name


class HuggingFaceAttention:
    """`AttentionFunctions` for Hugging Face models, whose attention layers call the function their config names:
    what the engine hands `apply_recompute`, so "selective" recomputes their attention cores, and whole blocks
    recompute without their key/value cache."""

    def found_in(self, blocks: list[nn.Module]) -> bool:
        return bool(_hf_attention_configs(blocks))

    def recompute(self, blocks: list[nn.Module]) -> None:
        for config in _hf_attention_configs(blocks):
            recompute_hf_attention(config)

    def prepare_blocks(self, blocks: list[nn.Module]) -> None:
        """A Hugging Face decoder layer with `use_cache` (Llama's default) appends its keys and values [b, kv, s, d]
        to the cache as it runs, so a replay would attend over 2s keys (eager attention then fails on its [b, 1,
        s, s] mask; sdpa's causal kernel hides it) and the cache would hold what recomputation drops. Their own
        switch for checkpointed layers (`GradientCheckpointingLayer.gradient_checkpointing`) passes no cache and
        `use_cache=False` in training under autograd; its checkpoint function is set to a plain call, ours wraps
        the layer."""
        try:
            from transformers.modeling_layers import GradientCheckpointingLayer
        except ImportError:       # an older transformers: its layers have no such switch and are left as they are
            return
        for block in blocks:
            if isinstance(block, GradientCheckpointingLayer):
                block.gradient_checkpointing = True
                setattr(block, "_gradient_checkpointing_func", _plain_call)


def _plain_call(function: Any, *args: Any) -> Any:
    """The checkpoint function a Hugging Face layer calls when it is checkpointed: shardwise's recomputation wraps
    the layer itself, so this runs it as it is."""
    return function(*args)


# -- the engine's entry point -------------------------------------------------------------------------

def parallelize_model(model: nn.Module, comm: Comm, *, sequence_parallel: bool = False) -> TensorParallelInfo:
    """Split a model the engine was given; anything else is a `TensorParallelError` saying what to provide:

    - the built-in GPT (and its Llama-style presets): `gpt_tp_plan` (Megatron's layout) and `parallelize_gpt`,
      which also installs the vocabulary-parallel loss, so the full logits are never gathered;
    - Hugging Face models that publish `config.base_model_tp_plan` (the Llama family; not GPT-2, which has none):
      `hf_tp_plan` reads the plan as transformers resolves it, `translate_hf_plan` translates transformers' style
      strings, and `parallelize_hf` applies it and adjusts the attention modules' head counts;
    - any other model carrying `shardwise_tp_plan`, a plan in our own styles (`parallel/tensor_parallel/plan.py`).

    (The pipeline cut of the built-in GPT is its own `GPT.pipeline_layers()`.)
    """
    if isinstance(model, GPT):
        if model.cfg.moe_experts:
            raise TensorParallelError(f"tensor_parallel.size = {comm.size} with an MoE model (moe_experts = "
                                      f"{model.cfg.moe_experts}) is not supported yet: use tensor_parallel.size = 1")
        return parallelize_gpt(model, comm, sequence_parallel=sequence_parallel)
    if is_hf_model(model):
        if sequence_parallel:
            raise TensorParallelError("tensor_parallel.sequence_parallel = true: Hugging Face plans describe no "
                                      "sequence-parallel layout; set it to false, or give the model a "
                                      "`shardwise_tp_plan` with sequence-parallel styles")
        return parallelize_hf(model, comm)
    plan = own_plan(model)
    if plan is not None:
        return apply_tensor_parallel(model, comm, plan)
    raise TensorParallelError(f"tensor_parallel.size = {comm.size}: shardwise does not know how to split a "
                              f"{type(model).__name__}; use shardwise.models.GPT, a Hugging Face model whose config "
                              f"has base_model_tp_plan, or set model.shardwise_tp_plan (module-name patterns -> "
                              f'"colwise", "rowwise", "vocab", ...; see shardwise.parallel.tensor_parallel.plan)')


# -- the torch-native entry point ---------------------------------------------------------------------

def parallelize_module(module: nn.Module, device_mesh: Any, parallelize_plan: Mapping[str, Any] | None = None, *,
                       sequence_parallel: bool = False) -> nn.Module:
    """Tensor parallelism in torch's shape (`torch.distributed.tensor.parallel.parallelize_module`), on shardwise's
    layers, as torchtitan composes it with `fully_shard`:

        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        shardwise.parallelize_module(model, mesh["tp"], {"blocks.*.mlp.fc": ColwiseParallel(),
                                                         "blocks.*.mlp.proj": RowwiseParallel()})
        for block in model.blocks:
            shardwise.fully_shard(block, mesh=mesh["dp"])
        shardwise.fully_shard(model, mesh=mesh["dp"])  # parameters: DTensors on the (dp, tp) mesh

    `device_mesh`: the 1-D tp mesh (or a ProcessGroup). `parallelize_plan`: module-name patterns (`*` for an
    index) -> torch's ColwiseParallel / RowwiseParallel / SequenceParallel objects or shardwise's style names
    (`parallel/tensor_parallel/plan.py`); None: the model's own plan (`parallelize_model`: the built-in GPT,
    Hugging Face models with a base_model_tp_plan, `shardwise_tp_plan`). Each named layer is replaced in place by
    one cut from it, whose parameters are this rank's plain slices; every parameter is marked with the tp mesh,
    so `fully_shard` over the dp mesh shows it as a DTensor of the whole model. Returns `module`. (A model split
    by torch's own `parallelize_module` also composes with `fully_shard`: `parallel/wrappers/torch_tp.py`.)"""
    from shardwise.comm.ledger import CommLedger
    from shardwise.errors import UserError
    group, mesh = device_mesh, None
    if hasattr(device_mesh, "get_group") and hasattr(device_mesh, "ndim"):       # torch's DeviceMesh
        if device_mesh.ndim != 1:
            raise UserError(f"parallelize_module: device_mesh is {device_mesh.ndim}-D; give its tp dimension, "
                            f'mesh["tp"]')
        group, mesh = device_mesh.get_group(), device_mesh
    comm = group if isinstance(group, Comm) else Comm(group, CommLedger(), name="tp")
    if parallelize_plan is None:
        parallelize_model(module, comm, sequence_parallel=sequence_parallel)
    else:
        apply_tensor_parallel(module, comm, parallelize_plan)
    if mesh is not None:
        for p in module.parameters():
            setattr(p, TP_MESH_ATTR, mesh)
    return module
