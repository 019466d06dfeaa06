"""The models the pipeline benchmark cuts into stages, and their data.

- "gpt": the built-in GPT (token embedding on the first stage; final norm, lm-head and cross-entropy on the
  last), what users train.
- "mlp": ``--layers`` identical residual MLP blocks on [micro-batch, seq, d] activations and a mean-squared
  error: every stage holds the same blocks and nothing else, which is what the bubble formula assumes (equal
  stage costs). It separates what the runtime adds to the bubble from what unequal stages add.
"""

from __future__ import annotations

import argparse

import torch
from torch import Tensor, nn

MODELS = ("gpt", "mlp")


class ResidualMLP(nn.Module):
    """x + W2 gelu(W1 norm(x)): [b, s, d] -> [b, s, d], hidden 4d (a transformer block without attention)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def build_model(args: argparse.Namespace, num_microbatches: int) -> tuple[nn.Module, Tensor, Tensor]:
    """The model (identical on every rank: seeded) and the whole batch (inputs, labels), M * micro_batch_size
    rows, which both implementations cut into M micro-batches along dim 0."""
    from shardwise.models import GPT, gpt_config
    from shardwise.parallel.pipeline.stage import PipelineModel

    torch.manual_seed(1234)
    g = torch.Generator().manual_seed(7)
    rows = num_microbatches * args.micro_batch_size
    if args.model == "mlp":
        model = PipelineModel([ResidualMLP(args.d_model) for _ in range(args.layers)], nn.functional.mse_loss)
        x = torch.randn(rows, args.seq, args.d_model, generator=g)      # [rows, seq, d]
        return model, x, torch.randn(rows, args.seq, args.d_model, generator=g)
    cfg = gpt_config("tiny", n_layer=args.layers, d_model=args.d_model, n_head=args.heads, seq_len=args.seq,
                     dropout=0.0, tie_embeddings=False)
    tokens = torch.randint(0, cfg.vocab_size, (rows, args.seq + 1), generator=g)   # inputs: first seq, labels: last
    return GPT(cfg), tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
