"""`zero.Init()` as a context for any nn.Module built inside it, at 2 ranks (one launch shared by every check).

- Construction: transformers' `AutoModelForCausalLM.from_config` (tied embeddings), `LlamaForCausalLM(cfg)`,
  `GPT2LMHeadModel(cfg)`, our GPT, and a nested module whose constructor writes `nn.Parameter(torch.zeros(8))`,
  creates a parameter after its children and rewrites the children's parameters (also converted with `.double()`
  in the block). Each rank is seeded differently
  inside the block: the gathered values must equal rank 0's seed's build outside the block, bit for bit, and tied
  weights must stay one parameter.
- `from_pretrained` inside the block (the default and `low_cpu_mem_usage=True`), from a full checkpoint and from a
  checkpoint that lacks the lm-head (transformers initializes it after loading): equal to the same call outside,
  within the memory bound below.
- Memory: the bytes held by the parameters of the modules being built (whole values, construction pieces, unit
  shards as they are allocated) measured at every registration and every torch function given a parameter; the
  peak stays under the shards plus one module's parameters (or one unit's new shard at the end of the block), far
  below the model; the same measurement on a build outside the block reaches the whole model.
- Training: `initialize` with ZeRO-3 (fp32) on a model built in the block gives the losses of the same model built
  without it (bitwise: same units, same arithmetic), and, where DeepSpeed runs, DeepSpeed's zero.Init + ZeRO-3 on
  the same weights (rtol 1e-5, the fp32 parity tolerance of the other DeepSpeed tests).
- The Hugging Face script: "auto" config values, zero.Init, initialize, train, save_checkpoint, then a new model
  built in a new block, load_checkpoint, and the next losses equal the uninterrupted run's (bitwise).
- Misuse gets one line saying what to do.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwise.testing import assert_close_lists, run_distributed, tiny_gpt

pytest.importorskip("transformers")

WORLD = 2
SEED = 100                 # rank r seeds SEED + r inside the block: rank 0's values must win
THRESHOLD = 4              # stage3_param_persistence_threshold: the 8-element zeros are sharded too
ZERO3 = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
         "gradient_clipping": 1.0, "steps_per_print": 10_000,
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": THRESHOLD,
                               "reduce_bucket_size": 4000}}
# The config a Hugging Face Trainer user writes: "auto" wherever the Trainer's own configs have it, except the
# learning rate (the Trainer fills it from its arguments; a script without the Trainer writes it).
HF_AUTO = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
           "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 10_000,
           "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": "auto", "eps": "auto",
                                                     "weight_decay": "auto", "torch_adam": True}},
           "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                                 "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto",
                                 "stage3_gather_16bit_weights_on_model_save": True}}
VOCAB, SEQ = 64, 8


def _llama_config(tied: bool):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                       tie_word_embeddings=tied)


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.zeros = nn.Parameter(torch.zeros(8))
        self.scale = nn.Parameter(torch.full((3, 5), 0.5))


class Outer(nn.Module):
    """Parameters created after the children, and children's parameters rewritten once they are complete."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Inner() for _ in range(3))
        self.table = nn.Parameter(torch.arange(30.0).view(5, 6))
        self.gain = nn.Parameter(torch.randn(7))
        with torch.no_grad():
            for k, layer in enumerate(self.layers):
                layer.lin.weight.mul_(k + 2)
                layer.lin.bias.copy_(self.table[k])
                layer.scale.data[0].fill_(-1.0)
            nn.init.normal_(self.layers[1].zeros, std=0.1)


def _builders() -> dict:
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaForCausalLM
    return {
        "auto_llama_tied": lambda: AutoModelForCausalLM.from_config(_llama_config(tied=True)),
        "llama": lambda: LlamaForCausalLM(_llama_config(tied=False)),
        "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                                   bos_token_id=0, eos_token_id=0)),
        "gpt": lambda: tiny_gpt(seq_len=SEQ, vocab_size=VOCAB, seed=None, tie_embeddings=True),
        "nested": Outer,
        "nested_converted": lambda: Outer().double(),     # a conversion in the block: the sharded pieces follow
    }


def _gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    from shardwise.zero import GatheredParameters
    named = dict(model.named_parameters())
    with GatheredParameters(list(named.values())):
        return {n: p.detach().clone() for n, p in named.items()}


def _ties(model: nn.Module) -> list[tuple[str, str]]:
    """Pairs of names that are one parameter."""
    seen: dict[int, str] = {}
    pairs = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            pairs.append((seen[id(p)], name))
        seen.setdefault(id(p), name)
    return pairs


def _construction(ds, rank: int) -> dict:
    from shardwise.parallel.zero.params import PARTITION_ATTR, default_unit_modules
    out = {}
    for name, build in _builders().items():
        torch.manual_seed(SEED + rank)
        with ds.zero.Init(config_dict_or_path=copy.deepcopy(ZERO3)):
            model = build()
        sharded = [n for n, p in model.named_parameters() if p.numel() == 0]
        out[name] = {"values": _gathered(model), "ties": _ties(model), "sharded": sharded,
                     "partitioned": hasattr(model, PARTITION_ATTR),
                     "blocks": [n for n, _ in default_unit_modules(model)]}     # recompute's blocks too
    return out


def _save_pretrained(tmp: str, rank: int) -> dict[str, str]:
    from transformers import LlamaForCausalLM, LlamaModel
    paths = {"full": os.path.join(tmp, "full"), "base": os.path.join(tmp, "base")}
    if rank == 0:
        torch.manual_seed(7)
        LlamaForCausalLM(_llama_config(tied=False)).save_pretrained(paths["full"])
        torch.manual_seed(8)
        LlamaModel(_llama_config(tied=False)).save_pretrained(paths["base"])   # no lm_head: initialized on load
    dist.barrier()
    return paths


def _pretrained(ds, rank: int, paths: dict[str, str]) -> dict:
    from transformers import AutoModelForCausalLM
    out = {}
    for label, path in paths.items():
        for kwargs in ({}, {"low_cpu_mem_usage": True}):
            key = f"{label}{'_low_cpu' if kwargs else ''}"
            torch.manual_seed(SEED)
            outside = AutoModelForCausalLM.from_pretrained(path, **kwargs)
            torch.manual_seed(SEED + rank)
            with _HeldBytes() as held:
                with ds.zero.Init(config_dict_or_path=copy.deepcopy(ZERO3)):
                    inside = AutoModelForCausalLM.from_pretrained(path, **kwargs)
            out[key] = {"outside": {n: p.detach().clone() for n, p in outside.named_parameters()},
                        "inside": _gathered(inside), "training": inside.training == outside.training,
                        "peak": held.peak, **_footprint(outside)}
    return out


class _HeldBytes(torch.overrides.TorchFunctionMode):
    """The bytes held by the parameters of every module registered so far (whole values, the construction shards
    and the unit shards, each storage once), measured at each registration and at each torch function given a
    parameter. Entered before zero.Init, so it sees each call after zero.Init's mode gathered what it touches."""

    def __init__(self) -> None:
        super().__init__()
        self.modules: dict[int, nn.Module] = {}
        self.flats: list = []          # every unit shard allocated, also before its model records its partition
        self.peak = 0
        self._hooks: list = []

    def __enter__(self):
        from torch.nn.modules import module as hooks
        from shardwise.parallel.zero.flat import FlatShard
        self._hooks = [hooks.register_module_module_registration_hook(self._on_child),
                       hooks.register_module_parameter_registration_hook(self._on_param)]
        self._allocate = FlatShard.__dict__["allocate"]

        def allocate(cls, *args, **kwargs):
            flat = self._allocate.__func__(cls, *args, **kwargs)
            self.flats.append(flat)
            return flat
        FlatShard.allocate = classmethod(allocate)
        return super().__enter__()

    def __exit__(self, *exc):
        from shardwise.parallel.zero.flat import FlatShard
        FlatShard.allocate = self._allocate
        for h in self._hooks:
            h.remove()
        return super().__exit__(*exc)

    def _on_child(self, module, name, child) -> None:
        self.modules.setdefault(id(module), module)
        self.measure()

    def _on_param(self, module, name, param) -> None:
        self.modules.setdefault(id(module), module)
        self.measure()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if any(isinstance(a, nn.Parameter) for a in [*args, *(kwargs or {}).values()]):
            self.measure()
        return result

    def measure(self) -> None:
        from shardwise.parallel.zero.construction import SHARD_ATTR
        with torch._C.DisableTorchFunction():       # reading storages must not gather anything
            storages: dict[int, int] = {}

            def add(t: torch.Tensor) -> None:
                s = t.untyped_storage()
                if s.nbytes():
                    storages[s.data_ptr()] = s.nbytes()
            for m in list(self.modules.values()):
                for p in m._parameters.values():
                    if p is not None:
                        add(p.data)
                        record = getattr(p, SHARD_ATTR, None)
                        if record is not None:
                            add(record.shard)
            for f in self.flats:
                add(f.shard)
            self.peak = max(self.peak, sum(storages.values()))


def _footprint(model: nn.Module) -> dict[str, int]:
    """What the memory bound is made of: the whole model, this rank's shards (per parameter, small ones whole),
    the largest module's own parameters and the largest unit (a child of the largest ModuleList)."""
    from shardwise.parallel.zero.params import default_unit_modules
    params = list(model.parameters())
    return {"total": sum(p.numel() * p.element_size() for p in params),
            "shards": sum(math.ceil(p.numel() / WORLD) * p.element_size() if p.numel() > THRESHOLD
                          else p.numel() * p.element_size() for p in params),
            "largest_module": max(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
                                  for m in model.modules()),
            "largest_unit": max(sum(p.numel() * p.element_size() for p in unit.parameters())
                                for _, unit in default_unit_modules(model))}


def _bound(m: dict[str, int]) -> int:
    """Beside the shards: one module whole (under construction, loaded or gathered), or, while the units are laid
    out at the end of the block, one unit's new shard (the whole-parameter transients are not counted)."""
    return m["shards"] + max(m["largest_module"], math.ceil(m["largest_unit"] / WORLD))


def _memory(ds, rank: int) -> dict:
    """A 6-block GPT (every block a unit; its largest module, an MLP projection, is ~6% of the model)."""
    def build():
        return tiny_gpt(n_layer=6, d_model=64, seq_len=SEQ, vocab_size=VOCAB, seed=None)
    out = {}
    torch.manual_seed(SEED)
    with _HeldBytes() as held:
        whole = build()
    out["outside_peak"] = held.peak
    out.update(_footprint(whole))
    reference = {n: p.detach().clone() for n, p in whole.named_parameters()}
    del whole
    torch.manual_seed(SEED + rank)
    with _HeldBytes() as held:
        with ds.zero.Init(config_dict_or_path=copy.deepcopy(ZERO3)):
            model = build()
    out["inside_peak"] = held.peak
    got = _gathered(model)
    out["equal"] = got.keys() == reference.keys() and all(torch.equal(got[n], reference[n]) for n in got)
    return out


# -- training --------------------------------------------------------------------------------------------

def _batches(rank: int, micro: int, gas: int, steps: int) -> list[list[torch.Tensor]]:
    """Per step, this rank's `gas` micro-batches [micro, SEQ] of one global batch."""
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        rows = torch.randint(0, VOCAB, (WORLD * gas * micro, SEQ), generator=g)
        out.append(list(rows[rank * gas * micro:(rank + 1) * gas * micro].chunk(gas)))
    return out


def _train(engine, rank: int, steps: int, start: int = 0) -> list[float]:
    losses = []
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    for batch in _batches(rank, micro, gas, start + steps)[start:]:
        for ids in batch:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    return losses


def _training(ds, rank: int, reference: dict[str, torch.Tensor]) -> dict:
    from transformers import AutoModelForCausalLM
    out = {}
    torch.manual_seed(SEED + rank)
    with ds.zero.Init(config_dict_or_path=copy.deepcopy(ZERO3)):
        model = AutoModelForCausalLM.from_config(_llama_config(tied=True))
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(ZERO3))
    out["fp32"] = {n: ds.utils.safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()}
    out["fp32_equal"] = all(torch.equal(out["fp32"][n], reference[n]) for n in out["fp32"])
    out["init"] = _train(engine, rank, steps=3)
    engine.destroy()
    torch.manual_seed(SEED)
    plain = AutoModelForCausalLM.from_config(_llama_config(tied=True))
    engine, *_ = ds.initialize(model=plain, model_parameters=plain.parameters(), config=copy.deepcopy(ZERO3))
    out["plain"] = _train(engine, rank, steps=3)
    engine.destroy()
    return out


def _deepspeed_training(rank: int, reference: dict[str, torch.Tensor]) -> list[float] | str:
    """DeepSpeed's zero.Init + ZeRO-3 on the same weights (its zero.Init leaves transformers' post_init writing into
    empty partitions, so the reference weights are written in with GatheredParameters, as scripts load them)."""
    try:
        from test_deepspeed_parity import _import_deepspeed
        deepspeed = _import_deepspeed()
    except ImportError:
        return "deepspeed is not installed"
    from transformers import AutoModelForCausalLM
    deepspeed.init_distributed(dist_backend="gloo")
    linear = torch.nn.functional.linear
    try:
        with deepspeed.zero.Init(config_dict_or_path=copy.deepcopy(ZERO3)):
            model = AutoModelForCausalLM.from_config(_llama_config(tied=True))
        named = dict(model.named_parameters())
        with deepspeed.zero.GatheredParameters(list(named.values()), modifier_rank=0):
            if rank == 0:
                for n, p in named.items():
                    p.data.copy_(reference[n])
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=copy.deepcopy(ZERO3))
        losses = _train(engine, rank, steps=3)
        engine.destroy()
        return losses
    finally:
        torch.nn.functional.linear = linear       # DeepSpeed's ZeRO-3 leaves its own in place


def _hf_script(tmp: str, rank: int) -> dict:
    """What a Hugging Face user writes, with `import shardwise as deepspeed`."""
    import shardwise as deepspeed
    from transformers import AutoModelForCausalLM

    def build():
        with deepspeed.zero.Init(config_dict_or_path=copy.deepcopy(HF_AUTO)):
            return AutoModelForCausalLM.from_config(_llama_config(tied=True))

    def start(model):
        loader = torch.utils.data.DataLoader(torch.zeros(8, SEQ, dtype=torch.long), batch_size=2)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=copy.deepcopy(HF_AUTO), training_data=loader)
        return engine

    torch.manual_seed(SEED)
    engine = start(build())
    out = {"gas": engine.gradient_accumulation_steps(), "micro": engine.train_micro_batch_size_per_gpu()}
    out["first"] = _train(engine, rank, steps=2)
    engine.save_checkpoint(tmp, tag="two")
    out["then"] = _train(engine, rank, steps=2, start=2)
    engine.destroy()
    torch.manual_seed(SEED + 50)                         # other weights: the checkpoint must replace them
    resumed = start(build())
    resumed.load_checkpoint(tmp, tag="two")
    out["resumed"] = _train(resumed, rank, steps=2, start=2)
    resumed.destroy()
    return out


def _misuse(ds) -> dict[str, str]:
    from shardwise.errors import UserError
    out = {}
    try:
        with ds.zero.Init():
            with torch.device("meta"):
                nn.Linear(4, 4)
    except UserError as e:
        out["meta"] = str(e)
    block = ds.zero.Init()
    try:
        with block:
            with block:
                pass
    except UserError as e:
        out["reentered"] = str(e)
    try:
        with ds.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3, "reduce_bucket_size": -1}}):
            pass
    except Exception as e:                  # the config's own error, raised on entering
        out["bad_config"] = type(e).__name__
    out["after_whole"] = nn.Linear(20, 20).weight.numel()    # no block left open by the failures above
    return out


def _nested_blocks(ds, rank: int) -> dict:
    """A block inside another joins it: both models sharded by the outer one, values as built outside."""
    torch.manual_seed(SEED + rank)
    with ds.zero.Init(config_dict_or_path=copy.deepcopy(ZERO3)):
        with ds.zero.Init(config_dict_or_path=copy.deepcopy(ZERO3)):
            first = Outer()
        second = Outer()
    return {"first": _gathered(first), "second": _gathered(second)}


def _ranks(tmp: str) -> dict:
    torch.set_num_threads(1)
    import shardwise
    rank = dist.get_rank()
    torch.manual_seed(SEED)
    from transformers import AutoModelForCausalLM
    reference = dict(AutoModelForCausalLM.from_config(_llama_config(tied=True)).named_parameters())
    reference = {n: p.detach().clone() for n, p in reference.items()}
    out = {"construction": _construction(shardwise, rank),
           "pretrained": _pretrained(shardwise, rank, _save_pretrained(tmp, rank)),
           "memory": _memory(shardwise, rank),
           "training": _training(shardwise, rank, reference),
           "script": _hf_script(os.path.join(tmp, "ckpt"), rank),
           "misuse": _misuse(shardwise),
           "nested_blocks": _nested_blocks(shardwise, rank)}
    out["deepspeed"] = _deepspeed_training(rank, reference)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_distributed(_ranks, WORLD, args=(str(tmp_path_factory.mktemp("zero_init")),), timeout=400)


# -- checks ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(_builders()))
def test_built_in_the_block_equals_the_build_outside(results: list[dict], name: str) -> None:
    from shardwise.parallel.zero.params import default_unit_modules
    torch.manual_seed(SEED)
    outside = _builders()[name]()
    want = {n: p.detach() for n, p in outside.named_parameters()}
    for rank, res in enumerate(results):
        got = res["construction"][name]
        assert got["partitioned"] and got["sharded"], f"rank {rank}: {name} was not sharded"
        assert got["values"].keys() == want.keys()
        for n, v in got["values"].items():
            assert v.dtype == want[n].dtype and torch.equal(v, want[n]), \
                f"rank {rank}: {name}.{n} differs from the build outside the block"
        assert got["ties"] == _ties(outside), f"rank {rank}: {name}'s tied weights"
        assert got["blocks"] == [n for n, _ in default_unit_modules(outside)], f"rank {rank}: {name}'s blocks"
    if name == "auto_llama_tied":
        assert _ties(outside), "the tied model ties nothing: the check above checks nothing"


def test_from_pretrained_in_the_block_equals_outside(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        assert set(res["pretrained"]) == {"full", "full_low_cpu", "base", "base_low_cpu"}
        for key, got in res["pretrained"].items():
            assert got["inside"].keys() == got["outside"].keys()
            for n, v in got["outside"].items():
                assert torch.equal(got["inside"][n], v), f"rank {rank}: from_pretrained {key}: {n}"
            assert got["training"]
            assert got["peak"] <= _bound(got) < got["total"], (rank, key, got["peak"], _bound(got), got["total"])


def test_a_rank_holds_its_shards_and_one_module(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        m = res["memory"]
        assert m["equal"], f"rank {rank}: the memory model's values differ from the build outside"
        assert m["outside_peak"] >= m["total"]                   # the measure sees a whole model
        assert m["inside_peak"] <= _bound(m), (rank, m)
        assert m["inside_peak"] < 0.7 * m["total"], (rank, m)


def test_trains_as_the_model_built_without_zero_init(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        got = res["training"]
        assert got["fp32_equal"], f"rank {rank}: safe_get_full_fp32_param differs from the build outside"
        assert got["init"] == got["plain"], f"rank {rank}: {got['init']} vs {got['plain']}"


def test_trains_as_deepspeed_zero_init(results: list[dict]) -> None:
    theirs = results[0]["deepspeed"]
    if isinstance(theirs, str):
        pytest.skip(theirs)
    for rank, res in enumerate(results):
        assert_close_lists(res["training"]["init"], res["deepspeed"], rtol=1e-5, what=f"rank {rank} losses")


def test_hugging_face_script_with_auto_config_saves_and_resumes(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        got = res["script"]
        assert (got["micro"], got["gas"]) == (2, 1)
        assert len(got["first"]) == len(got["then"]) == 2
        assert got["resumed"] == got["then"], f"rank {rank}: {got['resumed']} vs {got['then']}"


def test_misuse_says_what_to_do(results: list[dict]) -> None:
    for res in results:
        assert "still on the meta device" in res["misuse"]["meta"] and "zero.Init(module=model)" in \
            res["misuse"]["meta"]
        assert "already entered" in res["misuse"]["reentered"]
        assert res["misuse"]["bad_config"] == "ConfigError" and res["misuse"]["after_whole"] == 400


def test_a_block_inside_a_block_joins_it(results: list[dict]) -> None:
    torch.manual_seed(SEED)
    first, second = Outer(), Outer()
    for rank, res in enumerate(results):
        for label, model in (("first", first), ("second", second)):
            got = res["nested_blocks"][label]
            for n, p in model.named_parameters():
                assert torch.equal(got[n], p.detach()), f"rank {rank}: {label}.{n}"
