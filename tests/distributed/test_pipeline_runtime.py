"""The pipeline runtime equals single-process training, and its memory bound is measured.

One spawn of 4 gloo ranks (module fixture `runs`) executes every distributed case in phases:
- direct harness (stage split + runtime + a plain torch optimizer per stage): the GPT at P = 4 (world) and
  P = 2 (two pipelines at once on ranks {0,1} and {2,3}) with GPipe, 1F1B and interleaved 1F1B (V = 2);
- a no-deadlock sweep over P in {2, 3, 4}, M in {1, 2, 3, 5} and every schedule, on a layer-list model, with
  receives posted early (gloo's way) and with receives posted only in the grid batches (NCCL's way: every
  message has tag 0, so the sweep checks the order NCCL would match by);
- the engine: `shardwise.initialize` with a "pipeline" block, pp = 2 x dp = 2 (ZeRO 0, 1, 2, clipping) and
  pp = 4 x dp = 1, through `engine.train_batch`.
Losses and parameters are compared with the single-process reference (fp32, rtol = atol = 1e-5); measured
peak in-flight micro-batches with the schedule's bound; traces turn into Timelines and a PNG.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwise.parallel.pipeline import PipelineError, Timeline, build_schedule
from shardwise.parallel.pipeline.schedules import Op
from shardwise.testing import (
    assert_close_lists, assert_state_close, micro_steps, reference_train, run_distributed, state_copy, tiny_gpt,
    token_batches,
)

SEQ, D, MICRO, STEPS = 16, 32, 2, 2

# (P, schedule, V, M, layers): direct-harness cases; P = 2 ones run on two pipelines side by side.
DIRECT_P4 = [(4, "gpipe", 1, 4, 4), (4, "1f1b", 1, 6, 4), (4, "interleaved_1f1b", 2, 4, 8)]
DIRECT_P2 = [[(2, "gpipe", 1, 4, 4), (2, "1f1b", 1, 3, 4)],                         # ranks {0, 1}
             [(2, "interleaved_1f1b", 2, 4, 4), (2, "1f1b", 1, 5, 4)]]              # ranks {2, 3}
SWEEP = [(p, kind, m, eager) for p in (2, 3, 4) for kind in ("gpipe", "1f1b", "interleaved_1f1b") for m in (1, 2, 3, 5)
         for eager in (True, False)]
ENGINE = {
    # eps 1e-6: a v_proj weight's first gradient is rounding noise (2e-9); lr * g / (|g| + 1e-8) would amplify it
    "pp2dp2_adamw_1f1b": dict(pp=2, schedule="1f1b", v=1, gas=4, zero=0, clip=0.0,
                              optimizer={"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1, "eps": 1e-6}}),
    "pp2dp2_sgd_interleaved_clip": dict(pp=2, schedule="interleaved_1f1b", v=2, gas=2, zero=0, clip=0.1,
                                        optimizer={"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}),
    "pp2dp2_zero1_gpipe_clip": dict(pp=2, schedule="gpipe", v=1, gas=3, zero=1, clip=0.1,
                                    optimizer={"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}),
    "pp2dp2_zero2_1f1b_params": dict(pp=2, schedule="1f1b", v=1, gas=2, zero=2, clip=0.0, partition="parameters",
                                     optimizer={"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}),
    "pp4_sgd_gpipe_clip": dict(pp=4, schedule="gpipe", v=1, gas=2, zero=0, clip=0.1,
                               optimizer={"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}),
}


def gpt(n_layer: int) -> nn.Module:
    return tiny_gpt(n_layer=n_layer, d_model=D, seq_len=SEQ)


def layer_model() -> nn.Module:
    """A model given as a list of layers plus a loss: 24 layers, so uniform chunks fit every P * V <= 8 here."""
    from shardwise.parallel.pipeline.stage import PipelineModel
    torch.manual_seed(99)
    layers = [nn.Sequential(nn.Linear(12, 12), nn.Tanh()) for _ in range(24)]
    return PipelineModel(layers, nn.functional.mse_loss)


def gpt_steps(global_batch: int, micro_count: int, *, dp_size: int = 1, dp_rank: int = 0) -> list[list[tuple]]:
    return micro_steps(token_batches(STEPS, global_batch, SEQ + 1, seed=7), dp_size=dp_size, dp_rank=dp_rank,
                       grad_accum=micro_count)


def layer_steps(m: int) -> list[list[tuple]]:
    g = torch.Generator().manual_seed(m)
    return [[(torch.randn(3, 12, generator=g), torch.randn(3, 12, generator=g)) for _ in range(m)]
            for _ in range(STEPS)]


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


# ----- what runs on the ranks -----

def _direct(model: nn.Module, steps: list, *, p: int, stage: int, group, kind: str, v: int,
            eager: bool | None = None) -> dict:
    """The direct harness: split, runtime, plain SGD on the stage's parameters."""
    from shardwise.comm.collectives import Comm
    from shardwise.comm.ledger import CommLedger
    from shardwise.parallel.pipeline import runtime as runtime_module
    from shardwise.parallel.pipeline.runtime import PipelineRuntime
    from shardwise.parallel.pipeline.stage import split_model
    freed: list[int] = []
    free = runtime_module.free_data

    def counting_free(t: torch.Tensor) -> None:   # count the outputs whose data was dropped after sending
        free(t)
        freed.append(t.untyped_storage().nbytes() // t.element_size())

    runtime_module.free_data = counting_free
    module = split_model(model, num_stages=p, stage=stage, virtual_stages=v)
    ledger = CommLedger()
    # Metered on the first step only: the second checks the unmetered path (which outputs' data may go).
    runtime = PipelineRuntime(module, Comm(group, ledger, name="pp"), schedule=kind, num_microbatches=len(steps[0]),
                              measure_every=STEPS, eager_receives=eager)
    opt = sgd(module.parameters())
    results = []
    for k, micro in enumerate(steps):
        ledger.begin_step(k)
        opt.zero_grad()
        results.append(runtime.step(micro))
        opt.step()
    runtime.close()
    runtime_module.free_data = free
    sent = [ledger.bytes_by_op(k) for k in range(len(steps))]
    return {"losses": [r.loss for r in results], "peaks": [r.peak_in_flight for r in results],
            "measured": [r.measured for r in results],
            "records": [(r.stage, str(a.action), a.start, a.end) for r in results[-1:] for a in r.records],
            "state": {k: t.detach().clone() for k, t in module.full_state_dict().items()},
            "live": runtime.meter.live_keys, "bytes": sent, "freed": freed}


def _engine_case(name: str) -> dict:
    import shardwise
    from shardwise.errors import UserError
    case = ENGINE[name]
    model = gpt(4)
    world = dist.get_world_size()
    config = {"train_batch_size": MICRO * case["gas"] * world // case["pp"], "gradient_accumulation_steps": case["gas"],
              "gradient_clipping": case["clip"], "optimizer": case["optimizer"],
              "zero_optimization": {"stage": case["zero"], "reduce_bucket_size": 3000},
              "pipeline": {"stages": case["pp"], "schedule": case["schedule"], "virtual_stages": case["v"],
                           "partition": case.get("partition", "uniform")}}
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
    dp = world // case["pp"]
    steps = gpt_steps(MICRO * case["gas"] * dp, case["gas"], dp_size=dp, dp_rank=engine.dp_rank)
    losses = [engine.train_batch(iter(micro)) for micro in steps]
    out = {"losses": losses, "state": {k: t.detach().clone() for k, t in engine.module.full_state_dict().items()},
           "norm": engine.updater.last_grad_norm, "stage": engine.pipeline.stage.stage,
           "comm": engine.comm_report(), "activations": engine.memory_report()["activations"]}
    try:
        engine(steps[0][0])
    except UserError as e:   # the refusal only: any other failure fails the rank
        out["forward_error"] = str(e)
    engine.close()
    return out


def _all_phases() -> dict:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    trio = dist.new_group([0, 1, 2])
    out: dict = {"direct": {}, "sweep": {}, "engine": {}}
    for p, kind, v, m, layers in DIRECT_P4:
        out["direct"][(p, kind, v, m)] = _direct(gpt(layers), gpt_steps(MICRO * m, m), p=p, stage=rank,
                                                 group=None, kind=kind, v=v)
    for p, kind, v, m, layers in DIRECT_P2[rank // 2]:
        out["direct"][(p, kind, v, m)] = _direct(gpt(layers), gpt_steps(MICRO * m, m), p=p, stage=rank % 2,
                                                 group=pair[rank // 2], kind=kind, v=v)
    dist.barrier()
    for p, kind, m, eager in SWEEP:
        ranks = {2: [0, 1], 3: [0, 1, 2], 4: [0, 1, 2, 3]}[p]
        if rank in ranks:
            group = {2: pair[0], 3: trio, 4: None}[p]
            v = 2 if kind == "interleaved_1f1b" else 1
            out["sweep"][(p, kind, m, eager)] = _direct(layer_model(), layer_steps(m), p=p, stage=rank, group=group,
                                                        kind=kind, v=v, eager=eager)
        dist.barrier()
    for name in ENGINE:
        out["engine"][name] = _engine_case(name)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(_all_phases, 4, timeout=300)


# ----- single-process references -----

@lru_cache(maxsize=None)
def gpt_reference(layers: int, global_batch: int, micro_count: int, optimizer: str = "sgd",
                  clip: float = 0.0) -> tuple[list[float], dict]:
    model = gpt(layers)
    opt = sgd(model.parameters()) if optimizer == "sgd" else torch.optim.AdamW(model.parameters(), lr=3e-3,
                                                                                 weight_decay=0.1, eps=1e-6)
    losses = reference_train(model, opt, gpt_steps(global_batch, micro_count), loss_fn=lambda mod, mb: mod(*mb),
                             clip=clip or None)
    return losses, state_copy(model)


@lru_cache(maxsize=None)
def layer_reference(m: int) -> tuple[list[float], dict]:
    model = layer_model()
    losses = reference_train(model, sgd(model.parameters()), layer_steps(m), loss_fn=lambda mod, mb: mod(*mb))
    return losses, state_copy(model)


def gathered(parts: list[dict], what: str) -> dict:
    full: dict = {}
    for part in parts:
        for k, t in part.items():
            if k in full:   # a dp replica of the same stage: must hold the same values
                torch.testing.assert_close(t, full[k], rtol=0, atol=0, msg=lambda m: f"{what}: replicas differ {k}")
            full[k] = t
    return full


def expected_peaks(kind: str, p: int, m: int, v: int) -> list[int]:
    """In-flight bound of each stage from its action list: forwards done, backwards not yet."""
    peaks = []
    for actions in build_schedule(kind, num_stages=p, num_microbatches=m, virtual_stages=v):
        held = peak = 0
        for a in actions:
            held += 1 if a.op is Op.FORWARD else -1
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def case_ranks(p: int, kind: str, v: int, m: int) -> list[int]:
    if p == 4:
        return [0, 1, 2, 3]
    return [0, 1] if any(c[:4] == (p, kind, v, m) for c in DIRECT_P2[0]) else [2, 3]


# ----- the tests -----

@pytest.mark.parametrize("case", [c[:4] for c in DIRECT_P4] + [c[:4] for cs in DIRECT_P2 for c in cs],
                         ids=lambda c: f"P{c[0]}-{c[1]}-V{c[2]}-M{c[3]}")
def test_gpt_pipeline_matches_single_process(runs: list[dict], case: tuple) -> None:
    p, kind, v, m = case
    layers = next(c[4] for c in DIRECT_P4 + DIRECT_P2[0] + DIRECT_P2[1] if c[:4] == case)
    ranks = case_ranks(*case)
    got = [runs[r]["direct"][case] for r in ranks]
    ref_losses, ref_state = gpt_reference(layers, MICRO * m, m)
    assert_close_lists(got[-1]["losses"], ref_losses, rtol=1e-5, atol=1e-5, what=f"{case} losses")
    assert all(g["losses"] == [None] * STEPS for g in got[:-1]), "only the last stage computes the loss"
    assert_state_close(gathered([g["state"] for g in got], str(case)), ref_state, what=str(case))
    # Measured in-flight activations: 1F1B holds min(P - s, M) on stage s, GPipe M, interleaved its warm-up + 1.
    assert all(g["measured"] == [True] + [False] * (STEPS - 1) for g in got)
    measured = [g["peaks"][-1] for g in got]
    assert measured == expected_peaks(kind, p, m, v), f"{case}: measured peaks {measured}"
    if kind == "1f1b":
        assert measured == [min(p - s, m) for s in range(p)]
    if kind == "gpipe":
        assert measured == [m] * p
    assert all(g["live"] == [] for g in got), "saved activations outlived the step"
    # Every activation sent to another stage had its data dropped (1-element placeholder), except the loss chunk's.
    sends = [sum(1 for a in actions if a.op is Op.FORWARD and a.model_chunk(stage=s, num_stages=p) < p * v - 1)
             for s, actions in enumerate(build_schedule(kind, num_stages=p, num_microbatches=m, virtual_stages=v))]
    assert [g["freed"] for g in got] == [[1] * n * STEPS for n in sends]


@pytest.mark.parametrize("case", [c[:4] for c in DIRECT_P4 if c[1] == "1f1b"] + [(2, "interleaved_1f1b", 2, 4)],
                         ids=lambda c: f"P{c[0]}-{c[1]}")
def test_trace_becomes_a_timeline_and_a_picture(runs: list[dict], case: tuple, tmp_path) -> None:
    from shardwise.parallel.pipeline.timeline import draw_timeline
    p, kind, v, m = case
    records = [r for rank in case_ranks(*case) for r in runs[rank]["direct"][case]["records"]]
    timeline = Timeline.from_records(records, num_stages=p, name=f"measured {kind}")
    schedule = build_schedule(kind, num_stages=p, num_microbatches=m, virtual_stages=v)
    for s in range(p):
        assert [str(a) for a in timeline.order(s)] == [str(a) for a in schedule[s]]   # ran in schedule order
        rows = timeline.stage_records(s)
        assert all(a.end <= b.start for a, b in zip(rows, rows[1:])), "a stage ran two actions at once"
        assert timeline.peak_in_flight(s) == expected_peaks(kind, p, m, v)[s]
    assert 0.0 < float(timeline.bubble_fraction) < 1.0
    path = tmp_path / "timeline.png"
    draw_timeline(timeline, path, time_unit="s")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_transfer_goes_through_the_comm_ledger(runs: list[dict]) -> None:
    # P = 2 1F1B, M = 3 on ranks {0, 1}: per step stage 0 sends M activations [micro, SEQ, D] fp32 and receives
    # M gradients of the same shapes; shapes are agreed once, by one header (64 int64) in the first step only.
    activation = MICRO * SEQ * D * 4
    first = runs[0]["direct"][(2, "1f1b", 1, 3)]["bytes"]
    assert first == [{"send": 3 * activation + 64 * 8, "recv": 3 * activation}] + \
        [{"send": 3 * activation, "recv": 3 * activation}] * (STEPS - 1)
    last = runs[1]["direct"][(2, "1f1b", 1, 3)]["bytes"]
    assert last == [{"send": 3 * activation, "recv": 3 * activation + 64 * 8}] + \
        [{"send": 3 * activation, "recv": 3 * activation}] * (STEPS - 1)


@pytest.mark.parametrize("case", SWEEP, ids=lambda c: f"P{c[0]}-{c[1]}-M{c[2]}-{'early' if c[3] else 'grid'}")
def test_no_deadlock_and_layer_list_parity(runs: list[dict], case: tuple) -> None:
    p, kind, m, _ = case
    got = [runs[r]["sweep"][case] for r in range(p)]
    ref_losses, ref_state = layer_reference(m)
    assert_close_lists(got[-1]["losses"], ref_losses, rtol=1e-5, atol=1e-6, what=f"{case} losses")
    assert_state_close(gathered([g["state"] for g in got], str(case)), ref_state, what=str(case))
    v = 2 if kind == "interleaved_1f1b" else 1
    assert [g["peaks"][-1] for g in got] == expected_peaks(kind, p, m, v)


@pytest.mark.parametrize("name", list(ENGINE))
def test_engine_train_batch_matches_single_process(runs: list[dict], name: str) -> None:
    case = ENGINE[name]
    dp = 4 // case["pp"]
    results = [r["engine"][name] for r in runs]
    adam = case["optimizer"]["type"] == "AdamW"
    ref_losses, ref_state = gpt_reference(4, MICRO * case["gas"] * dp, case["gas"] * dp,
                                          "adamw" if adam else "sgd", case["clip"])
    for rank, res in enumerate(results):   # the mean loss on every rank, broadcast from the last stage
        assert_close_lists(res["losses"], ref_losses, rtol=1e-5, atol=1e-5, what=f"{name} rank {rank} losses")
        assert "train_batch" in res["forward_error"]
        assert res["activations"] > 0
    assert_state_close(gathered([r["state"] for r in results], name), ref_state, what=name, adam=adam)
    if case["clip"]:
        norms = {r["norm"] for r in results}
        assert len(norms) == 1 and norms.pop() > case["clip"], f"{name}: every stage clips by the global norm"
    p2p = [c for c in results[0]["comm"] if c["group"] == "pp" and c["op"] in ("send", "recv")]
    assert p2p and all(c["count"] > 0 for c in p2p)


# ----- in-process checks (no spawn) -----

def test_one_stage_with_two_chunks_hands_off_locally() -> None:
    from shardwise.comm.collectives import Comm
    from shardwise.comm.ledger import CommLedger
    from shardwise.parallel.pipeline.runtime import PipelineRuntime
    from shardwise.parallel.pipeline.stage import split_model
    model = gpt(4)
    stage = split_model(model, num_stages=1, stage=0, virtual_stages=2)
    ledger = CommLedger()
    runtime = PipelineRuntime(stage, Comm(None, ledger), schedule="interleaved_1f1b", num_microbatches=3)
    opt = sgd(stage.parameters())
    losses = []
    for micro in gpt_steps(MICRO * 3, 3):
        opt.zero_grad()
        losses.append(runtime.step(micro).loss)
        opt.step()
    ref_losses, ref_state = gpt_reference(4, MICRO * 3, 3)
    assert_close_lists(losses, ref_losses, rtol=1e-6, what="P=1 V=2 losses")
    assert_state_close(stage.full_state_dict(), ref_state, what="P=1 V=2")
    assert ledger.records == []


def test_split_errors_name_the_fix() -> None:
    from shardwise.parallel.pipeline.stage import PipelineModel, split_model
    with pytest.raises(PipelineError, match="more than the model's 4 layer"):
        split_model(gpt(4), num_stages=5, stage=0)
    with pytest.raises(PipelineError, match="must be a multiple of 6"):
        split_model(gpt(8), num_stages=3, stage=0, virtual_stages=2)
    with pytest.raises(PipelineError, match="needs a loss function: pass loss_fn="):
        split_model(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), num_stages=2, stage=0)
    with pytest.raises(PipelineError, match="needs a sample micro-batch"):
        split_model(layer_model(), num_stages=2, stage=0, partition="flops")
    with pytest.raises(PipelineError, match="did you mean 'parameters'"):
        split_model(layer_model(), num_stages=2, stage=0, partition="parameter")
    with pytest.raises(PipelineError, match="cannot split a Linear"):
        split_model(nn.Linear(2, 2), num_stages=2, stage=0)
    with pytest.raises(PipelineError, match="loss_fn must be callable"):
        PipelineModel([nn.Linear(2, 2)], loss_fn=None)  # type: ignore[arg-type]


def test_partitions_balance_parameters_and_flops() -> None:
    from shardwise.parallel.pipeline.stage import PipelineModel, layer_costs, split_model
    widths = [(4, 64), (64, 64), (64, 64), (64, 4), (4, 4), (4, 4)]
    model = PipelineModel([nn.Linear(a, b) for a, b in widths], nn.functional.mse_loss,
                          sample_input=torch.zeros(2, 4))
    assert layer_costs(model, "parameters") == [float(a * b + b) for a, b in widths]
    assert layer_costs(model, "flops") == [float(2 * 2 * a * b) for a, b in widths]
    by = {method: [split_model(model, num_stages=2, stage=s, partition=method).layer_ranges[0] for s in (0, 1)]
          for method in ("uniform", "parameters", "flops")}
    assert by["uniform"] == [range(0, 3), range(3, 6)]
    assert by["parameters"] == [range(0, 2), range(2, 6)] == by["flops"]
    # GPT: the embedding's and the head's parameters count with the first and the last block.
    model = gpt(4)
    costs = layer_costs(model, "parameters")
    block = sum(p.numel() for p in model.blocks[0].parameters())
    assert costs[1] == costs[2] == block and costs[0] > block and costs[3] > block
    flops = layer_costs(model, "flops")
    assert flops[0] == flops[1] == flops[2] < flops[3]       # the lm-head matmul rides with the last block


def test_micro_batch_format_errors() -> None:
    from shardwise.comm.collectives import Comm
    from shardwise.comm.ledger import CommLedger
    from shardwise.parallel.pipeline.runtime import PipelineRuntime
    from shardwise.parallel.pipeline.stage import split_model
    runtime = PipelineRuntime(split_model(layer_model(), num_stages=1, stage=0), Comm(None, CommLedger()),
                              schedule="1f1b", num_microbatches=2)
    with pytest.raises(PipelineError, match="needs 2 micro-batches"):
        runtime.step([(torch.zeros(3, 12), torch.zeros(3, 12))])
    with pytest.raises(PipelineError, match=r"must be a pair \(inputs, labels\)"):
        runtime.step([torch.zeros(3, 12), torch.zeros(3, 12)])
