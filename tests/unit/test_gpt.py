"""Reference GPT: shapes, loss, causality, training, init, parameter/FLOP counts, presets."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from shardwise.models import GPT, PRESETS, GPTConfig, gpt_config, gpt_flops_per_token, gpt_num_params

SMALL = dict(vocab_size=256, seq_len=32, n_layer=2, n_head=4, d_model=64)


def build(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**SMALL, **overrides}))


def ids(b: int = 2, s: int = 32, vocab: int = 256, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


VARIANTS = {
    "learned": {},
    "rotary": dict(positions="rotary"),
    "gqa-rotary": dict(positions="rotary", n_kv_head=2),
    "tied-nobias": dict(tie_embeddings=True, bias=False),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_shapes_and_loss_at_init(variant: str) -> None:
    model = build(**VARIANTS[variant])
    x = ids()
    logits = model(x)
    assert logits.shape == (2, 32, 256) and logits.dtype == torch.float32
    loss = model(x, labels=ids(seed=2))   # not x itself: a tied head favours repeating its input
    assert loss.shape == ()
    # Small init -> near-uniform predictions -> cross-entropy close to ln(vocab).
    assert abs(loss.item() - math.log(256)) < 0.1, loss.item()


@pytest.mark.parametrize("variant", VARIANTS)
def test_causal(variant: str) -> None:
    model = build(**VARIANTS[variant]).eval()
    x = ids()
    y = x.clone()
    y[:, 20:] = (y[:, 20:] + 7) % 256          # change only the future from position 20 on
    a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :20], b[:, :20], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_labels_minus_100_are_ignored() -> None:
    model = build()
    x = ids()
    labels = ids(seed=2)
    masked = labels.clone()
    masked[:, ::2] = -100
    logits = model(x)
    keep = masked != -100
    expected = F.cross_entropy(logits[keep], labels[keep])
    torch.testing.assert_close(model(x, labels=masked), expected)
    torch.testing.assert_close(GPT.loss(logits, masked), expected)


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_trains_on_repeated_batch(positions: str) -> None:
    model = build(positions=positions)
    x = ids(b=4, seed=3)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = model(x[:, :-1], labels=x[:, 1:])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses


def test_separable_path_equals_forward() -> None:
    model = build(positions="rotary", n_kv_head=2)
    x, labels = ids(), ids(seed=2)
    h = model.embed_forward(x)
    assert h.shape == (2, 32, 64)
    for block in model.blocks:
        h = block(h)
    logits = model.head_forward(h)
    torch.testing.assert_close(logits, model(x), rtol=0, atol=0)
    torch.testing.assert_close(model.loss(logits, labels), model(x, labels=labels), rtol=0, atol=0)


def test_structure_is_splittable() -> None:
    model = build(n_kv_head=2, tie_embeddings=True)
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 2
    attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
    assert (attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features) == (64, 32, 32)
    assert (attn.o_proj.in_features, mlp.fc_in.out_features, mlp.fc_out.in_features) == (64, 256, 256)
    assert model.head.lm_head.weight is model.embed.tok.weight
    assert build(positions="rotary").embed.pos is None


def test_deterministic_init() -> None:
    a, b, c = build(seed=5).state_dict(), build(seed=5).state_dict(), build(seed=6).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["blocks.0.attn.q_proj.weight"], c["blocks.0.attn.q_proj.weight"])


def test_init_follows_gpt2() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, seq_len=64, n_layer=8, n_head=4, d_model=256)
    model = GPT(cfg)
    block = model.blocks[3]
    resid = 0.02 / math.sqrt(2 * 8)
    assert abs(block.attn.q_proj.weight.std().item() - 0.02) < 0.001
    assert abs(block.mlp.fc_in.weight.std().item() - 0.02) < 0.001
    assert abs(block.attn.o_proj.weight.std().item() - resid) < 0.0005
    assert abs(block.mlp.fc_out.weight.std().item() - resid) < 0.0005
    assert abs(model.embed.tok.weight.std().item() - 0.02) < 0.001
    assert torch.count_nonzero(block.attn.q_proj.bias) == 0 and torch.count_nonzero(block.mlp.fc_out.bias) == 0
    assert torch.all(block.ln_1.weight == 1) and torch.all(model.head.norm.weight == 1)


# -- counting --------------------------------------------------------------------------------------

COUNT_VARIANTS = [{}, dict(bias=False), dict(tie_embeddings=True), dict(positions="rotary"),
                  dict(n_kv_head=1, d_ff=100), dict(n_kv_head=2, positions="rotary", tie_embeddings=True, bias=False)]


@pytest.mark.parametrize("overrides", COUNT_VARIANTS)
def test_num_params_matches_pure_count(overrides: dict) -> None:
    model = build(**overrides)
    for exclude in (False, True):
        assert model.num_params(exclude) == gpt_num_params(model.cfg, exclude_embeddings=exclude)


@pytest.mark.parametrize("name", list(PRESETS))
def test_num_params_matches_for_every_preset(name: str) -> None:
    cfg = PRESETS[name]
    if name in ("tiny", "small"):
        model = GPT(cfg)
    else:   # the shapes are what matters; meta tensors make a 1.3B model free to build
        with torch.device("meta"):
            model = GPT(cfg)
    assert model.num_params() == gpt_num_params(cfg)
    assert model.num_params(exclude_embeddings=True) == gpt_num_params(cfg, exclude_embeddings=True)


def test_gpt2_124m_counts_by_hand() -> None:
    cfg = gpt_config("gpt2-124m")
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.vocab_size, cfg.seq_len, cfg.tie_embeddings) == \
        (12, 768, 12, 50257, 1024, True)
    assert gpt_num_params(cfg) == 124_439_808                   # the released GPT-2 small checkpoint
    # 12 blocks of (12 d^2 + 13 d) plus the final norm's 2 d.
    assert gpt_num_params(cfg, exclude_embeddings=True) == 12 * (12 * 768**2 + 13 * 768) + 2 * 768 == 85_056_000
    assert gpt_num_params(gpt_config("350m")) == 354_823_168   # GPT-2 medium
    # 6 * (85,056,000 non-embedding + 50257 * 768 tied head) + 6 * 12 layers * 1024 * 768.
    assert gpt_flops_per_token(cfg) == 6 * 123_653_376 + 56_623_104 == 798_543_360


def test_flops_per_token_by_hand_untied() -> None:
    model = build()   # d=64, d_ff=256, L=2, s=32, vocab 256, learned, untied, biases
    d, f, L, s, V = 64, 256, 2, 32, 256
    per_block = (4 * d * d + 4 * d) + (d * f + f) + (f * d + d) + 4 * d   # attn, fc_in, fc_out, 2 norms
    n = L * per_block + 2 * d + V * d                                     # + final norm + untied lm-head
    assert n == 116_480
    assert model.num_params(exclude_embeddings=True) == n
    assert model.flops_per_token() == 6 * n + 6 * L * s * d == 723_456
    tied = build(tie_embeddings=True)
    assert tied.flops_per_token() == model.flops_per_token()   # the head matmul runs either way


# -- config and presets ----------------------------------------------------------------------------

def test_presets_build_configs() -> None:
    assert set(PRESETS) == {"tiny", "small", "gpt2-124m", "350m", "1.3b", "llama-tiny", "llama-small", "llama-7b",
                            "llama-13b", "llama-70b", *(f"gpt3-{s}" for s in
                                                       ("125m", "350m", "760m", "1.3b", "2.7b", "6.7b", "13b", "175b"))}
    assert 1_000_000 < gpt_num_params(PRESETS["tiny"]) < 5_000_000
    assert 10_000_000 <= gpt_num_params(PRESETS["small"]) <= 20_000_000
    big = PRESETS["1.3b"]
    assert (big.n_layer, big.d_model, big.n_head, big.seq_len) == (24, 2048, 16, 2048)
    assert gpt_config("TINY") == PRESETS["tiny"]


def test_overrides_rederive_defaults() -> None:
    cfg = gpt_config("tiny", d_model=96, n_head=4, positions="rotary")
    assert cfg.d_ff == 4 * 96 and cfg.n_kv_head == 4 and cfg.positions == "rotary"
    assert gpt_config("tiny", d_ff=100).d_ff == 100


def test_unknown_preset_lists_names_and_closest() -> None:
    with pytest.raises(ValueError, match="unknown GPT preset 'gpt2-124'") as err:
        gpt_config("gpt2-124")
    assert "tiny, small, gpt2-124m, 350m, 1.3b" in str(err.value)
    assert "Did you mean 'gpt2-124m'?" in str(err.value)
    with pytest.raises(ValueError, match="unknown field.*'n_layers' \\(did you mean 'n_layer'\\?\\)"):
        gpt_config("tiny", n_layers=3)


@pytest.mark.parametrize("overrides, message", [
    (dict(d_model=100, n_head=3), "d_model=100 is not divisible by n_head=3"),
    (dict(n_head=4, n_kv_head=3), "n_head=4 is not divisible by n_kv_head=3"),
    (dict(d_model=36, n_head=4, positions="rotary"), "needs an even head dim.*= 9"),
    (dict(positions="alibi"), "positions='alibi' is not one of \\['learned', 'rotary'\\]"),
    (dict(n_layer=0), "n_layer=0 must be a positive integer"),
    (dict(dropout=1.0), "dropout=1.0 must be in \\[0, 1\\)"),
])
def test_config_validation(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GPTConfig(**{**SMALL, **overrides})


def test_too_long_sequence_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="input sequence length 33 exceeds the model's seq_len 32"):
        build()(ids(s=33))


def test_rotary_scores_depend_only_on_relative_position() -> None:
    from shardwise.models.gpt import apply_rotary, rotary_cos_sin
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16, generator=g), torch.randn(1, 1, 1, 16, generator=g)
    cos, sin = rotary_cos_sin(40, 16, 10000.0, torch.device("cpu"))

    def score(m: int, n: int) -> float:   # query at position m, key at position n
        qm = apply_rotary(q, cos[m:m + 1], sin[m:m + 1])
        kn = apply_rotary(k, cos[n:n + 1], sin[n:n + 1])
        return float((qm * kn).sum())

    assert score(5, 2) == pytest.approx(score(35, 32), abs=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 4), abs=1e-3)
    torch.testing.assert_close(apply_rotary(q, cos[7:8], sin[7:8]).norm(), q.norm())   # a rotation


def test_meta_build_materialises_to_the_same_model() -> None:
    cfg = GPTConfig(**SMALL, tie_embeddings=True)
    with torch.device("meta"):
        lazy = GPT(cfg)
    lazy.to_empty(device="cpu")
    torch.manual_seed(3)
    lazy.init_weights()                     # same RNG draws in the same order as a direct build
    assert lazy.head.lm_head.weight is lazy.embed.tok.weight
    direct = build(seed=3, tie_embeddings=True)
    assert all(torch.equal(a, b) for a, b in zip(lazy.state_dict().values(), direct.state_dict().values()))
