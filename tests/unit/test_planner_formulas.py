"""Planner formulas against published tables (ZeRO, Megatron-LM, GPT-3, Korthikanti et al.) and hand-computed
values."""

from __future__ import annotations

import dataclasses
from decimal import ROUND_DOWN, ROUND_HALF_UP, Decimal

import pytest

from shardwise.models.presets import PRESETS, GPTConfig, gpt_flops_per_token, gpt_num_params
from shardwise.planner import (
    Op, Optimizer, PipelineSchedule, Precision, Recompute, bubble_fraction, bubble_ratio, flops_per_token,
    forward_flops, iteration_flops, layer_activation_bytes, max_trainable_params, model_preset, model_state_bytes,
    narayanan_params, narayanan_train_seconds, param_count, peak_in_flight, pipeline_seconds, ring_seconds,
    ring_send_bytes, six_nd, zero_paper_volume,
)

DAY = 86_400

# -- ZeRO paper Table 1: per-device model-state memory, GB = 1e9 bytes, mixed-precision Adam (K = 12) ----------

ZERO_TABLE_1 = {  # dp -> {(psi, stage): paper's cell}
    1: {(7.5e9, 1): "120", (7.5e9, 2): "120", (7.5e9, 3): "120", (128e9, 1): "2048", (128e9, 2): "2048",
        (128e9, 3): "2048", (1000e9, 1): "16000", (1000e9, 2): "16000", (1000e9, 3): "16000"},
    4: {(7.5e9, 1): "52.5", (7.5e9, 2): "41.3", (7.5e9, 3): "30", (128e9, 1): "896", (128e9, 2): "704",
        (128e9, 3): "512", (1000e9, 1): "7000", (1000e9, 2): "5500", (1000e9, 3): "4000"},
    16: {(7.5e9, 1): "35.6", (7.5e9, 2): "21.6", (7.5e9, 3): "7.5", (128e9, 1): "608", (128e9, 2): "368",
         (128e9, 3): "128", (1000e9, 1): "4750", (1000e9, 2): "2875", (1000e9, 3): "1000"},
    64: {(7.5e9, 1): "31.4", (7.5e9, 2): "16.6", (7.5e9, 3): "1.88", (128e9, 1): "536", (128e9, 2): "284",
         (128e9, 3): "32", (1000e9, 1): "4187", (1000e9, 2): "2218", (1000e9, 3): "250"},
    256: {(7.5e9, 1): "30.4", (7.5e9, 2): "15.4", (7.5e9, 3): "0.47", (128e9, 1): "518", (128e9, 2): "263",
          (128e9, 3): "8", (1000e9, 1): "4046", (1000e9, 2): "2054", (1000e9, 3): "62.5"},
    1024: {(7.5e9, 1): "30.1", (7.5e9, 2): "15.1", (7.5e9, 3): "0.12", (128e9, 1): "513", (128e9, 2): "257",
           (128e9, 3): "2", (1000e9, 1): "4011", (1000e9, 2): "2013", (1000e9, 3): "15.6"},
}
CELLS = [(dp, psi, stage, cell) for dp, row in ZERO_TABLE_1.items() for (psi, stage), cell in row.items()]


def _as_printed(value: float, cell: str, rounding: str) -> str:
    """`value` with as many decimals as the paper's cell, rounded (half up) or truncated."""
    places = len(cell.split(".")[1]) if "." in cell else 0
    return str(Decimal(repr(value)).quantize(Decimal(1).scaleb(-places), rounding=rounding))


@pytest.mark.parametrize("dp,psi,stage,cell", CELLS, ids=[f"dp{c[0]}-{c[1]:.3g}-stage{c[2]}" for c in CELLS])
def test_zero_paper_table_1_cell(dp: int, psi: float, stage: int, cell: str) -> None:
    gb = model_state_bytes(int(psi), precision=Precision.FP16, optimizer=Optimizer.ADAM, zero_stage=stage,
                           dp=dp).total / 1e9
    # The paper rounds most cells and truncates some (4187.5 -> 4187, 35.625 -> 35.6): either must match.
    assert cell in (_as_printed(gb, cell, ROUND_HALF_UP), _as_printed(gb, cell, ROUND_DOWN)), gb


def test_zero_paper_formulas_per_parameter() -> None:
    psi, n = 10**9, 8
    assert model_state_bytes(psi, zero_stage=0, dp=n).total == 16 * psi
    assert model_state_bytes(psi, zero_stage=1, dp=n).total == 4 * psi + 12 * psi // n
    assert model_state_bytes(psi, zero_stage=2, dp=n).total == 2 * psi + 14 * psi // n
    assert model_state_bytes(psi, zero_stage=3, dp=n).total == 16 * psi // n
    # fp32 Adam: 4 weights + 4 grads + 8 (m, v; the weights are the master); SGD with momentum: 4 + 4 + 4
    assert model_state_bytes(psi, precision=Precision.FP32).total == 16 * psi
    assert model_state_bytes(psi, precision=Precision.FP32, optimizer=Optimizer.SGD_MOMENTUM).total == 12 * psi
    assert model_state_bytes(7, zero_stage=3, dp=2).weights == 2 * 4    # ceil(7 / 2): ZeRO pads the shard


@pytest.mark.parametrize("mp,stage,paper_billions", [
    (1, 0, 2), (1, 1, 7.6), (1, 2, 14.4), (1, 3, 128), (2, 1, 15.2), (4, 2, 57.6), (8, 1, 60.8), (16, 2, 230.4),
    (16, 3, 2048),
])
def test_zero_paper_table_2_theoretical_max_model(mp: int, stage: int, paper_billions: float) -> None:
    # 32 GB V100s, N_d = 64 data-parallel ranks; the paper multiplies its rounded MP = 1 figure by MP
    psi = max_trainable_params(32e9, zero_stage=stage, dp=64)
    assert round(psi / 1e9, 1) * mp == pytest.approx(paper_billions, rel=1e-12)


# -- parameters and FLOPs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(PRESETS))
def test_our_gpt_presets_counted_exactly(name: str) -> None:
    spec = model_preset(name)
    assert param_count(spec).total == gpt_num_params(PRESETS[name])
    assert param_count(spec).non_embedding == gpt_num_params(PRESETS[name], exclude_embeddings=True)
    assert flops_per_token(spec, causal=True) == gpt_flops_per_token(PRESETS[name])


def test_published_model_counts() -> None:
    assert param_count(model_preset("llama-7b")).total == 6_738_415_616       # LLaMA 7B
    assert param_count(model_preset("llama-70b")).total == 68_976_648_192     # Llama 2 70B (GQA, 8 kv heads)
    gpt3 = param_count(model_preset("gpt3-175b")).total
    assert round(gpt3 / 1e9, 1) == 174.6                                      # Brown et al. Table D.1's N
    # Narayanan eq. 2 counts the same GPT except the final LayerNorm (2h)
    eq2 = narayanan_params(n_layer=96, d_model=12288, vocab_size=50257, seq_len=2048)
    assert gpt3 - eq2 == pytest.approx(2 * 12288, abs=1e-3)


@pytest.mark.parametrize("layers,hidden,billions", [
    (24, 2304, 1.65), (30, 3072, 3.56), (36, 4096, 7.47), (40, 6144, 18.45), (48, 8192, 39.10),
    (60, 10240, 76.05), (80, 12288, 145.62), (96, 16384, 310.13), (105, 20480, 529.60), (128, 25600, 1008.04),
])
def test_narayanan_table_1_parameter_rows(layers: int, hidden: int, billions: float) -> None:
    p = narayanan_params(n_layer=layers, d_model=hidden, vocab_size=51200, seq_len=2048)
    assert round(p / 1e9, 2) == pytest.approx(billions, abs=1e-9)


def _hand_model() -> GPTConfig:
    # 1 layer, d 4, 1 head, d_ff 16, vocab 8, seq 2, no biases, tied: numbers small enough to count by hand
    return GPTConfig(n_layer=1, d_model=4, n_head=1, d_ff=16, vocab_size=8, seq_len=2, mlp="gelu", norm="rmsnorm",
                     positions="rotary", bias=False, tie_embeddings=True, dropout=0.0)


def test_hand_counted_params_and_flops() -> None:
    m = _hand_model()
    # q, k, v, o: 4 * 16 = 64; MLP 2 * 4 * 16 = 128; two RMSNorms 8 -> 200; embedding 32; final norm 4
    assert param_count(m).total == 236
    f = forward_flops(m, batch=1, seq_len=2)
    assert (f.dense, f.attention, f.logits) == (2 * 2 * 192, 4 * 4 * 4, 2 * 2 * 4 * 8)   # 768, 64, 128
    assert iteration_flops(m, batch=1, seq_len=2) == 3 * (768 + 64 + 128)                   # 2880
    assert iteration_flops(m, batch=1, seq_len=2, recompute=Recompute.FULL) == 4 * (768 + 64) + 3 * 128
    assert iteration_flops(m, batch=1, seq_len=2, recompute=Recompute.SELECTIVE) == 3 * 768 + 6 * 64 + 3 * 128
    assert forward_flops(m, batch=1, seq_len=2, causal=True).attention == 32
    # our convention: 6 * (blocks + final norm + head V * d) + 6 L s d (causal) = 6 * (200 + 4 + 32) + 6 * 8
    assert flops_per_token(m, causal=True) == 6 * 236 + 48


def test_narayanan_iteration_flops_for_gpt3_shape() -> None:
    gpt3 = dataclasses.replace(model_preset("gpt3-175b"), vocab_size=51200)
    b, s, l, h, v = 1536, 2048, 96, 12288, 51200
    f96 = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    f72 = 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    f72_selective = 72 * b * s * l * h * h * (1 + s / (3 * h) + v / (12 * l * h))
    assert iteration_flops(gpt3, batch=b, seq_len=s, recompute=Recompute.FULL) == pytest.approx(f96, rel=1e-12)
    assert iteration_flops(gpt3, batch=b, seq_len=s) == pytest.approx(f72, rel=1e-12)
    assert iteration_flops(gpt3, batch=b, seq_len=s, recompute=Recompute.SELECTIVE) == pytest.approx(f72_selective,
                                                                                                   rel=1e-12)
    assert round(f96 / 1e18, 3) == 4.511 and round(f72 / 1e18, 3) == 3.386


def test_gpt3_training_compute() -> None:
    flops = six_nd(175e9, 300e9)
    assert flops == pytest.approx(3.15e23, rel=1e-12)                      # 6ND with the round N = 175e9
    assert round(six_nd(param_count(model_preset("gpt3-175b")).total, 300e9) / 1e23, 2) == 3.14   # GPT-3 Table D.1
    assert round(six_nd(174.6e9, 300e9) / 8.64e19) == 3637                 # 3.64E+03 petaflop/s-days
    gpu_seconds = flops / 312e12
    assert gpu_seconds == pytest.approx(1.0096e9, rel=1e-4)
    assert round(gpu_seconds / DAY) == 11_685                              # A100-days at 100% of peak
    # Narayanan eq. 4, GPT-3 on 1024 A100s at 140 TFLOP/s achieved: "about 1000 A100s for about 34 days"
    days = narayanan_train_seconds(tokens=300e9, num_params=175e9, num_gpus=1024, achieved_flops=140e12) / DAY
    assert round(days, 1) == 33.9 and round(days) == 34
    one_t = narayanan_train_seconds(tokens=450e9, num_params=1e12, num_gpus=3072, achieved_flops=163e12) / DAY
    assert round(one_t, 1) == 83.2


# -- activations (Korthikanti et al. 2022) --------------------------------------------------------------------

GPT3 = model_preset("gpt3-175b")
SBH = 2048 * 1 * 12288
SCORES = 5 * 96 * 2048 / 12288          # 5as/h = 80


@pytest.mark.parametrize("tp,sp,recompute,per_sbh", [
    (1, False, Recompute.NONE, 34 + SCORES),                      # eq. 1
    (8, False, Recompute.NONE, 10 + 24 / 8 + SCORES / 8),         # eq. 2
    (8, True, Recompute.NONE, (34 + SCORES) / 8),                 # eq. 4
    (8, False, Recompute.SELECTIVE, 10 + 24 / 8),                 # TP + selective
    (8, True, Recompute.SELECTIVE, 34 / 8),                       # eq. 6
    (1, False, Recompute.FULL, 2),                                # full: the layer input only
    (8, True, Recompute.FULL, 2 / 8),
])
def test_korthikanti_activation_memory(tp: int, sp: bool, recompute: Recompute, per_sbh: float) -> None:
    got = layer_activation_bytes(GPT3, micro_batch=1, seq_len=2048, tp=tp, sequence_parallel=sp,
                                 recompute=recompute, act_bytes=2)
    assert got == pytest.approx(SBH * per_sbh, rel=1e-12)


def test_activation_generalisation_for_other_ffn_widths() -> None:
    # Korthikanti's 34 s b h + 5 a s^2 b bytes per layer holds 16 s b h for the two 2-byte MLP tensors of width
    # 4h; with any d_ff that part is 4 s b d_ff, so the layer holds s b (18h + 4 d_ff + 5 a s)
    m = dataclasses.replace(GPT3, d_ff=3 * 12288)
    got = layer_activation_bytes(m, micro_batch=1, seq_len=2048, act_bytes=2)
    assert got == pytest.approx(2048 * (18 * 12288 + 4 * 3 * 12288 + 5 * 96 * 2048), rel=1e-12)


# -- communication and pipeline -------------------------------------------------------------------------------

def test_ring_volumes_and_alpha_beta_times_by_hand() -> None:
    assert ring_send_bytes(Op.ALL_REDUCE, 100, 4) == 150              # 2 (p - 1) / p * n
    assert ring_send_bytes(Op.REDUCE_SCATTER, 100, 4) == 75           # (p - 1) / p * n, n = the full tensor
    assert ring_send_bytes(Op.ALL_GATHER, 100, 4) == 75
    assert ring_send_bytes(Op.ALL_REDUCE, 100, 1) == 0
    assert ring_send_bytes(Op.SEND, 100, 2) == 100
    # 2 (p - 1) alpha + 2 (p - 1) / p * n / B = 14e-5 + 1.75e9 / 1e11
    assert ring_seconds(Op.ALL_REDUCE, 1e9, 8, bandwidth=1e11, latency_s=1e-5) == pytest.approx(0.01764, rel=1e-12)
    assert ring_seconds(Op.ALL_GATHER, 1e9, 8, bandwidth=1e11, latency_s=1e-5, messages=3) == pytest.approx(
        3 * 7e-5 + 0.875e9 / 1e11, rel=1e-12)
    assert ring_seconds(Op.SEND, 1e6, 2, bandwidth=1e9, latency_s=2e-6) == pytest.approx(1.002e-3, rel=1e-12)
    assert zero_paper_volume(10, 0) == zero_paper_volume(10, 2) == 20 and zero_paper_volume(10, 3) == 30


def test_bubble_by_hand() -> None:
    one_f_one_b = PipelineSchedule.ONE_F_ONE_B
    assert bubble_fraction(one_f_one_b, num_stages=4, num_microbatches=8) == pytest.approx(3 / 11)
    assert bubble_fraction(PipelineSchedule.GPIPE, num_stages=4, num_microbatches=8) == pytest.approx(3 / 11)
    assert bubble_ratio(one_f_one_b, num_stages=4, num_microbatches=8) == pytest.approx(3 / 8)
    assert bubble_fraction(PipelineSchedule.INTERLEAVED_1F1B, num_stages=4, num_microbatches=8,
                           virtual_stages=2) == pytest.approx(1.5 / 9.5)
    assert bubble_fraction(one_f_one_b, num_stages=1, num_microbatches=8) == 0
    assert pipeline_seconds(microbatch_seconds=2.0, stages=4, microbatches=8) == pytest.approx(22.0)
    assert [peak_in_flight(stage=r, stages=4, microbatches=8) for r in range(4)] == [4, 3, 2, 1]
    assert peak_in_flight(stage=0, stages=4, microbatches=2) == 2
    assert peak_in_flight(stage=3, stages=4, microbatches=8, schedule=PipelineSchedule.GPIPE) == 8
