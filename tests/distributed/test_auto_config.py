"""`shardwise.initialize` fills a config full of Hugging Face "auto" values (hidden size from the model, micro-batch
from a DataLoader, learning rate and warmup from `auto=`) and trains a step with it."""

from __future__ import annotations

import torch

from shardwise.testing import run_distributed, tiny_gpt

SEQ, MICRO, D_MODEL = 8, 2, 32

AUTO_CONFIG = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "overlap_comm": "auto", "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"},
}


def _train_with_autos() -> dict:
    import warnings

    import shardwise
    from torch.utils.data import DataLoader
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(0, 256, (4 * MICRO, SEQ + 1), generator=g)
    loader = DataLoader([(r[:-1], r[1:]) for r in rows], batch_size=MICRO)
    model = tiny_gpt(seq_len=SEQ, d_model=D_MODEL)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, optimizer, engine_loader, scheduler = shardwise.initialize(
            model=model, model_parameters=model.parameters(), config=AUTO_CONFIG, training_data=loader,
            auto=shardwise.AutoValues(lr=1e-3, warmup_num_steps=10))
    loss = engine.train_batch()
    cfg = engine.config
    return {"batch": (cfg.batch.train_batch_size, cfg.batch.micro_batch, cfg.batch.grad_accum),
            "zero": (cfg.zero.reduce_bucket_size, cfg.zero.stage3_prefetch_bucket_size,
                     cfg.zero.stage3_param_persistence_threshold, cfg.zero.overlap_comm),
            "clip": cfg.gradient_clipping, "dtype": cfg.precision.dtype.value,
            "optimizer": dict(cfg.optimizer.params), "scheduler": dict(cfg.scheduler.params),
            "loader_batch": next(iter(engine_loader))[0].shape[0], "loss": float(loss),
            "warnings": [str(w.message) for w in caught if issubclass(w.category, shardwise.ConfigWarning)]}


def test_a_config_full_of_auto_trains_a_step():
    out = run_distributed(_train_with_autos, 1, timeout=180)[0]
    assert out["batch"] == (MICRO, MICRO, 1)
    h = D_MODEL
    assert out["zero"] == (h * h, int(0.9 * h * h), 10 * h, True)
    assert out["clip"] == 1.0 and out["dtype"] == "fp32"
    assert out["optimizer"] == {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    assert out["scheduler"] == {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10}
    assert out["loader_batch"] == MICRO and torch.isfinite(torch.tensor(out["loss"]))
    assert out["warnings"] == ['"zero_optimization.overlap_comm": "auto" dropped, its default applies '
                               '(DeepSpeed drops "auto" here too)']
