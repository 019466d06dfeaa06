"""Reference decoder-only GPT: pre-norm blocks, causal SDPA attention, GELU MLP; with `norm="rmsnorm"`,
`mlp="swiglu"` and rotary positions the same code is a Llama (`llama_layers.py`).

The model is written to be cut apart by the parallelism functions, never to know about them:

    model.embed    token embedding (+ learned positions)      ids [b, s]   -> x [b, s, d]
    model.blocks   nn.ModuleList of Block                        x [b, s, d]  -> x [b, s, d]
    model.head     final LayerNorm + lm-head Linear              x [b, s, d]  -> logits [b, s, vocab]
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import TYPE_CHECKING, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardwise.errors import UserError
from shardwise.models.llama_layers import RMSNorm, SwiGLU, make_norm
from shardwise.models.presets import GPTConfig, gpt_flops_per_token, gpt_num_params

if TYPE_CHECKING:
    from shardwise.parallel.pipeline.stage import PipelineLayers

IGNORE_INDEX = -100
"""Label value excluded from the loss (torch's cross_entropy default)."""


def contiguous_positions(seq_len: int, device: torch.device) -> Tensor:
    """The positions of a whole sequence of `seq_len` tokens: [seq_len] = 0 .. seq_len-1. The default of the
    `position_ids` attribute of `Embedding` and `Attention`; context parallelism installs the positions of the
    tokens a rank holds instead (`models/context_parallel.py`)."""
    return torch.arange(seq_len, device=device)


class Embedding(nn.Module):
    """Token embedding plus, for positions="learned", a position table; then dropout."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.positions == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.position_ids: Callable[[int, torch.device], Tensor] = contiguous_positions
        """(local length, device) -> the positions of the tokens held: [s]."""

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self.tok(input_ids)                                    # [b, s, d]
        if self.pos is not None:
            s = input_ids.shape[-1]
            if s > self.pos.num_embeddings:
                raise ValueError(f"input sequence length {s} exceeds the model's seq_len "
                                 f"{self.pos.num_embeddings} (learned positions have one row per position); "
                                 f"feed shorter sequences or build the model with a larger seq_len.")
            x = x + self.pos(self.position_ids(s, input_ids.device))    # [s, d] broadcast over batch
        return self.drop(x)


def rotary_cos_sin(positions: int | Tensor, head_dim: int, theta: float,
                   device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """cos and sin tables [s, head_dim] in fp32 for the token positions [s] (an int s: positions 0 .. s-1).
    Feature i and i + head_dim/2 form a pair that rotates at frequency theta^(-2i / head_dim) (the half-split
    layout of GPT-NeoX and Llama)."""
    if isinstance(positions, int):
        positions = torch.arange(positions, device=device)
    device = positions.device
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(positions.to(torch.float32), inv_freq)                                # [s, hd/2]
    angles = torch.cat([angles, angles], dim=-1)                                               # [s, hd]
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [b, h, s, hd] by position; cos/sin are [s, hd]. Computed in fp32, returned in x.dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)   # the pair partner, sign-flipped
    return (xf * cos + rotated * sin).to(x.dtype)


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(hd), causal) v with dropout on the probabilities: q [b, h, s, hd], k and v
    [b, h_kv, s, hd] (grouped-query: each kv head serves h / h_kv consecutive query heads) -> [b, h, s, hd].
    No parameters; a module of its own so tensor parallelism can draw its dropout masks from the TP rank's
    own random stream (each rank holds other heads), and context parallelism can put its attention in its
    place (taking kv heads unrepeated, it sends no repeated bytes)."""

    is_attention_core = True      # what selective activation recomputation recomputes

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              dropout_p=self.dropout if self.training else 0.0)


class Attention(nn.Module):
    """Causal multi-head (or grouped-query) self-attention with separate q/k/v/o projections."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d, kv = cfg.d_model, cfg.kv_dim
        self.q_proj = nn.Linear(d, d, bias=cfg.bias)
        self.k_proj = nn.Linear(d, kv, bias=cfg.bias)
        self.v_proj = nn.Linear(d, kv, bias=cfg.bias)
        self.o_proj = nn.Linear(d, d, bias=cfg.bias)
        self.head_dim = cfg.head_dim
        self.rotary_theta = cfg.rope_theta if cfg.positions == "rotary" else None
        self.core: nn.Module = CoreAttention(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.position_ids: Callable[[int, torch.device], Tensor] = contiguous_positions
        """(local length, device) -> the positions of the tokens held, for the rotary angles: [s]."""

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        # Heads are inferred from the projection widths, so a tensor-parallel shard with fewer
        # (local) heads runs through the same code.
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)   # [b, h, s, hd]
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)   # [b, h_kv, s, hd]
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)   # [b, h_kv, s, hd]
        if self.rotary_theta is not None:
            cos, sin = rotary_cos_sin(self.position_ids(s, x.device), self.head_dim, self.rotary_theta)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = self.core(q, k, v).transpose(1, 2).reshape(b, s, -1)            # [b, s, h * hd]
        return self.resid_drop(self.o_proj(y))


class MLP(nn.Module):
    """fc_in (d -> d_ff), GELU (tanh approximation, as GPT-2), fc_out (d_ff -> d)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.d_ff is not None
        self.fc_in = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.act = nn.GELU(approximate="tanh")
        self.fc_out = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.fc_out(self.act(self.fc_in(x))))


def make_mlp(cfg: GPTConfig, d_ff: int | None = None) -> nn.Module:
    """The config's MLP kind, of width `d_ff` (default cfg.d_ff)."""
    if d_ff is not None:
        cfg = dataclasses.replace(cfg, d_ff=d_ff)
    return SwiGLU(cfg) if cfg.mlp == "swiglu" else MLP(cfg)


def make_moe(cfg: GPTConfig) -> nn.Module:
    """An MoE layer of the config: moe_experts experts of the config's MLP kind and width moe_d_ff, top-k routing,
    the shared experts as one MLP beside them. Its loss (aux and z-loss, with their coefficients) is added to
    the training loss by `GPT.forward`."""
    from shardwise.parallel.experts import MoEConfig, MoELayer, ScoreFunction
    moe = MoEConfig(num_experts=cfg.moe_experts, top_k=cfg.moe_top_k, score=ScoreFunction(cfg.moe_score),
                    drop_tokens=cfg.moe_capacity_factor is not None,
                    capacity_factor=cfg.moe_capacity_factor or 1.0, eval_capacity_factor=cfg.moe_capacity_factor or 1.0,
                    aux_loss_coef=cfg.moe_aux_loss_coef, z_loss_coef=cfg.moe_z_loss_coef)
    width = cfg.moe_d_ff
    assert width is not None
    shared = make_mlp(cfg, cfg.moe_shared_experts * width) if cfg.moe_shared_experts else None
    return MoELayer(cfg.d_model, moe, make_expert=lambda: make_mlp(cfg, width), shared=shared)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x)). [b, s, d] -> [b, s, d]. In an MoE
    block `mlp` is an MoE layer (`parallel/experts`) of the config's experts."""

    def __init__(self, cfg: GPTConfig, index: int = 0) -> None:
        super().__init__()
        self.ln_1 = make_norm(cfg)
        self.attn = Attention(cfg)
        self.ln_2 = make_norm(cfg)
        self.mlp = make_moe(cfg) if cfg.is_moe_block(index) else make_mlp(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    """Final norm and the lm-head projection to vocabulary logits (no bias)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.norm(x))


@contextlib.contextmanager
def _rng_rewound() -> Iterator[None]:
    """Restore the RNG of the default device (and the CPU's) on exit."""
    device = torch.get_default_device()
    if device.type in ("cpu", "meta"):
        with torch.random.fork_rng(devices=[]):
            yield
    else:
        with torch.random.fork_rng(device_type=device.type):
            yield


class GPT(nn.Module):
    """Decoder-only language model. `model(ids)` -> logits [b, s, vocab];
    `model(ids, labels)` -> scalar mean cross-entropy over every token whose label is not -100.

    Labels are aligned with inputs (label[t] is the token that should follow input[t]); the loader
    already shifts them, so no shift happens here.

    Pipeline parallelism hands contiguous slices of `blocks` to stages (`pipeline_layers` says so); tensor
    parallelism swaps `attn.q_proj/k_proj/v_proj` and `mlp.fc_in` (and `mlp.fc_gate`) for column-parallel and
    `attn.o_proj`, `mlp.fc_out` for row-parallel layers (the plan: `parallelize.py`). Attention reads the number
    of (local) heads from the projection outputs, so a module holding n_head / tp heads runs unchanged."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # torch's per-module default inits are overwritten by init_weights; rewinding the RNG past
        # them makes the weights depend on init_weights' draws alone, so a meta-device build followed
        # by to_empty() + init_weights() under the same seed equals this direct build.
        with _rng_rewound():
            self.embed = Embedding(cfg)
            self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
            self.head = Head(cfg)
        self.init_weights()

    def tie_weights(self) -> None:
        """With tie_embeddings, make the lm-head weight the token-embedding Parameter (one Parameter). Needed
        again after `to_empty()` (a meta-device build), which gives each module its own new tensor. A pipeline
        split that puts embed and head on different stages keeps a copy on each and sums their gradients
        (`parallel/pipeline/tied.py`)."""
        if self.cfg.tie_embeddings:
            self.head.lm_head.weight = self.embed.tok.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 init, drawn from torch's global RNG in module order (so `torch.manual_seed` fixes it):
        weights ~ N(0, init_std); the two residual output projections (o_proj, fc_out) use
        init_std / sqrt(2 * n_layer) so the residual stream's variance does not grow with depth;
        biases 0; norm weights 1. Public so a model built on the meta device can be materialised
        (`to_empty`) and initialised afterwards; it re-ties the embeddings first."""
        self.tie_weights()
        std = self.cfg.init_std
        resid_std = std / math.sqrt(2 * self.cfg.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                if module is self.head.lm_head and self.cfg.tie_embeddings:
                    continue   # the token table, initialised as an Embedding
                is_resid_out = name.endswith(("attn.o_proj", "mlp.fc_out")) or (
                    ".mlp." in name and name.endswith("fc_out"))      # an expert's (routed or shared)
                nn.init.normal_(module.weight, mean=0.0, std=resid_std if is_resid_out else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    # -- separable stages (pipeline parallelism runs these on different ranks) --------------------

    def embed_forward(self, input_ids: Tensor) -> Tensor:
        """ids [b, s] (int64) -> hidden states [b, s, d_model]."""
        return self.embed(input_ids)

    def head_forward(self, x: Tensor) -> Tensor:
        """hidden states [b, s, d_model] -> logits [b, s, vocab_size]."""
        return self.head(x)

    def pipeline_layers(self) -> PipelineLayers:
        """This model as a pipeline's layers: the blocks are partitioned into stages; the embedding travels with
        the first block and the head (final norm, lm-head) with the last; the loss is `self.loss` (the
        vocabulary-parallel one once tensor parallelism has split the head). The sample micro-batch, one
        sequence of ids [1, s], serves "flops" partitioning."""
        from shardwise.parallel.pipeline.stage import PipelineLayers
        if self.cfg.moe_experts:
            # The pipeline's loss is `self.loss` alone: the routers' losses would be left out of training.
            raise UserError(f"pipeline parallelism of an MoE model (moe_experts = {self.cfg.moe_experts}) is not "
                            f"supported yet: use pipeline.stages = 1")
        sample = torch.zeros(1, self.cfg.seq_len, dtype=torch.long, device=self.embed.tok.weight.device)
        return PipelineLayers([(f"blocks.{i}", b) for i, b in enumerate(self.blocks)], self.loss,
                              prefix=[("embed", self.embed)], suffix=[("head", self.head)], sample_input=sample)

    @staticmethod
    def token_loss_sum(logits: Tensor, labels: Tensor) -> Tensor:
        """The sum of the token cross-entropies whose label != -100 (fp32): what context parallelism adds up
        over the ranks holding parts of one sequence before dividing by the valid tokens of all of them."""
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")

    @staticmethod
    def loss(logits: Tensor, labels: Tensor) -> Tensor:
        """Mean cross-entropy over tokens whose label != -100. logits [b, s, V], labels [b, s].
        Computed in fp32 whatever the logits dtype (low-precision log-softmax loses the loss)."""
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               ignore_index=IGNORE_INDEX)

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> Tensor:
        x = self.embed_forward(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head_forward(x)
        if labels is None:
            return logits
        loss = self.loss(logits, labels)
        if self.cfg.moe_experts:
            from shardwise.parallel.experts import moe_loss
            extra = moe_loss(self)          # the routers' load-balancing and z-losses, with their coefficients
            if extra is not None:
                loss = loss + extra
        return loss

    # -- accounting ---------------------------------------------------------------------------------

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Exact count of this module's parameters, shared (tied) ones once. exclude_embeddings drops
        the token and learned-position tables (see `gpt_num_params`, which gives the same number from
        the config alone)."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.embed.tok.weight.numel()
            if self.embed.pos is not None:
                total -= self.embed.pos.weight.numel()
        return total

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6 * N + 6 * n_layer * seq_len * d_model, N the matmul
        parameters (non-embedding plus the lm-head). See `gpt_flops_per_token` for the derivation."""
        return gpt_flops_per_token(self.cfg)

    def extra_repr(self) -> str:
        return f"params={gpt_num_params(self.cfg):,}"
