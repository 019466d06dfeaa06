"""What `--model` names, resolved once, and how each rank builds it.

    --model tiny | llama-7b | gpt3-1.3b      a preset of `presets.py` (our GPT code, Llama-style or GPT-style)
    --model hf:PATH                          a Hugging Face model: PATH is a config.json, or a directory holding
                                             one (and, when it holds `save_pretrained` weights, those are loaded)

`resolve_model` validates in the parent process; `build_model` makes the module on a rank.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from shardwise.errors import UserError
from shardwise.models.presets import GPTConfig, gpt_config, gpt_flops_per_token

HF_PREFIX = "hf:"
MODEL_FILE = "model.json"
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                   "pytorch_model.bin.index.json")


@dataclass(frozen=True, kw_only=True)
class ModelChoice:
    """A resolved `--model`. Exactly one of `gpt` (our model's config fields) and `hf_path` is set. Plain data,
    written to RUN_DIR/model.json so that `shardwise eval / generate / export` rebuild the same model from a
    checkpoint."""

    spec: str                          # as the user gave it
    seq_len: int
    vocab_size: int
    gpt: dict[str, Any] | None = None  # GPTConfig fields
    hf_path: str | None = None         # absolute directory holding config.json
    hf_weights: bool = False           # the directory holds save_pretrained weights: load them

    @property
    def is_hf(self) -> bool:
        return self.hf_path is not None

    def gpt_config(self) -> GPTConfig:
        assert self.gpt is not None
        return GPTConfig(**self.gpt)

    def write(self, path: Path) -> Path:
        from shardwise.checkpoint.files import atomic_write_text
        atomic_write_text(path, json.dumps(dataclasses.asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def read(cls, path: Path) -> "ModelChoice":
        return cls(**json.loads(path.read_text(encoding="utf-8")))


def resolve_model(spec: str, *, seq_len: int | None = None, vocab_size: int | None = None) -> ModelChoice:
    """Check `--model` (with `--seq-len` / `--vocab-size` overrides); UserError naming the flag and the fix.
    Torch-free for presets; transformers reads an HF config."""
    if spec.startswith(HF_PREFIX):
        return _resolve_hf(spec, seq_len, vocab_size)
    overrides = {k: v for k, v in (("seq_len", seq_len), ("vocab_size", vocab_size)) if v is not None}
    try:
        cfg = gpt_config(spec, **overrides)
    except ValueError as e:
        raise UserError(f"--model {spec!r}: {e} Or give a Hugging Face model as --model hf:PATH.") from None
    return ModelChoice(spec=spec, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size, gpt=dataclasses.asdict(cfg))


def _hf_dir(spec: str) -> Path:
    path = Path(spec[len(HF_PREFIX):]).expanduser()
    if path.is_file() and path.name.endswith(".json"):
        path = path.parent if path.name == "config.json" else path
    if path.is_file():
        raise UserError(f"--model {spec!r}: give the config.json of a Hugging Face model (named config.json) or "
                        f"the directory holding it")
    if not (path / "config.json").is_file():
        raise UserError(f"--model {spec!r}: no config.json in {str(path)!r}; give a directory written by "
                        f"save_pretrained, or one holding the model's config.json")
    return path.resolve()


def _resolve_hf(spec: str, seq_len: int | None, vocab_size: int | None) -> ModelChoice:
    path = _hf_dir(spec)
    try:
        from transformers import AutoConfig
    except ImportError:
        raise UserError(f"--model {spec!r} needs transformers: pip install transformers") from None
    try:
        config = AutoConfig.from_pretrained(str(path))
    except (ValueError, OSError, KeyError) as e:
        raise UserError(f"--model {spec!r}: transformers cannot read {path / 'config.json'}: "
                        f"{str(e).splitlines()[0]}") from None
    weights = any((path / f).is_file() for f in HF_WEIGHT_FILES)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab_size is not None and vocab_size != vocab:
        if weights:
            raise UserError(f"--vocab-size {vocab_size}: the weights in {str(path)!r} have vocab_size {vocab}; "
                            f"leave --vocab-size out (or use a config.json without weights)")
        vocab = vocab_size
    context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if seq_len is None:
        if not context:
            raise UserError(f"--model {spec!r}: the config gives no context length; pass --seq-len")
        seq_len = int(context)
    elif context and seq_len > int(context):
        raise UserError(f"--seq-len {seq_len}: longer than the model's context {context} "
                        f"(max_position_embeddings); use --seq-len {context} or less")
    return ModelChoice(spec=spec, seq_len=int(seq_len), vocab_size=vocab, hf_path=str(path), hf_weights=weights)


def build_model(choice: ModelChoice) -> Any:
    """The model, on this rank: our GPT from its config (the caller seeds torch first), or the transformers model
    (randomly initialised from its config under the same seed, or with the directory's weights)."""
    if choice.hf_path is None:
        from shardwise.models.gpt import GPT
        return GPT(choice.gpt_config())
    from transformers import AutoConfig, AutoModelForCausalLM
    if choice.hf_weights:
        return AutoModelForCausalLM.from_pretrained(choice.hf_path, dtype="float32")
    config = AutoConfig.from_pretrained(choice.hf_path)
    config.vocab_size = choice.vocab_size
    return AutoModelForCausalLM.from_config(config)


def flops_per_token(choice: ModelChoice, model: Any) -> float:
    """Training FLOPs per token at the run's sequence length: our analytic count, or 6 N + 6 L s d for an HF
    model (N its parameters less the input embedding; the count our GPT uses)."""
    if not choice.is_hf:
        return float(gpt_flops_per_token(choice.gpt_config()))
    cfg = model.config
    n = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    if getattr(cfg, "tie_word_embeddings", False):
        n += model.get_input_embeddings().weight.numel()          # the head's matmul runs anyway
    layers = _first_set(cfg, "num_hidden_layers", "n_layer")
    width = _first_set(cfg, "hidden_size", "n_embd")
    return float(6 * n + 6 * layers * choice.seq_len * width)


def _first_set(config: Any, *names: str) -> int:
    """The first of `names` a transformers config sets (model families name their sizes differently), else 0."""
    for name in names:
        value = getattr(config, name, None)
        if value:
            return int(value)
    return 0


def hf_batch(batch: tuple[Any, Any]) -> dict[str, Any]:
    """(input_ids, labels) [b, s] with labels already shifted -> a transformers causal LM's keywords.
    Hugging Face causal-LM heads shift their labels by one themselves; ours go in as `shift_labels=`, so the loss
    is the same next-token cross-entropy."""
    input_ids, labels = batch
    return {"input_ids": input_ids, "labels": labels, "shift_labels": labels}


class HFBatches:
    """Our loader's micro-batches as transformers keywords; the loader (and its state) stays reachable."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        return hf_batch(next(self.loader))


def model_batches(choice: ModelChoice, loader: Any) -> Any:
    """What to hand `engine.train_batch` / `eval_batch`: the loader itself, or its batches as HF keywords."""
    return HFBatches(loader) if choice.is_hf else loader


def find_model_file(start: Path) -> Path | None:
    """RUN_DIR/model.json for a run directory or any checkpoint path inside it (tag, checkpoints dir)."""
    for d in [start, *start.parents][:4]:
        if (d / MODEL_FILE).is_file():
            return d / MODEL_FILE
    return None
