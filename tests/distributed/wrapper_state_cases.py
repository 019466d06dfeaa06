"""Saving and resuming the module wrappers (`shardwise.get_state_dict` / `set_state_dict`, FSDP1's
`optim_state_dict`) and their `comm_report()`: the rank-side cases, run inside test_wrappers.py's 2- and 4-rank
launches, and the checks on what they return.

The resume case trains 3 AdamW steps at 2 ranks, saves the full model and optimizer state, and resumes for 3 more
at 4 ranks (given on every rank, or by rank 0 alone with broadcast_from_rank0), in one process (a world of one)
and unwrapped: each must equal the 2-rank run that went on."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from shardwise.testing import assert_close_lists, assert_state_close, lm_pair, shard_global_batch, tiny_gpt

SEQ = 16
ADAMW = dict(lr=3e-3, weight_decay=0.1)


def batches() -> list[torch.Tensor]:
    from shardwise.testing import token_batches
    return token_batches(6, 8, SEQ + 1, seed=11)      # 8 rows: 4, 2 or 1 per rank at 2, 4 or 1 rank(s)


def train(model, opt, steps: list[torch.Tensor], group=None) -> list[float]:
    """Plain loop, one micro-batch per step; the loss averaged over `group` (None: this process alone)."""
    dp = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    losses = []
    for b in steps:
        opt.zero_grad()
        ids, labels = lm_pair(shard_global_batch(b, dp_size=dp, dp_rank=rank, grad_accum=1)[0])
        loss = model(input_ids=ids, labels=labels)
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        if group is not None:
            dist.all_reduce(total, group=group)
        losses.append(float(total) / dp)
    return losses


def accumulate(model, opt, batch: torch.Tensor, sync_off) -> None:
    """One step of two micro-batches, the first inside `sync_off()` (no gradient communication)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    opt.zero_grad()
    for k, rows in enumerate(shard_global_batch(batch, dp_size=world, dp_rank=rank, grad_accum=2)):
        with sync_off() if k == 0 else contextlib.nullcontext():
            (model(*lm_pair(rows)) / 2).backward()
    opt.step()


def grad_sync_off(model):
    """A no_sync-like context for a fully_shard'ed model: set_requires_gradient_sync(False) inside."""
    @contextlib.contextmanager
    def ctx():
        model.set_requires_gradient_sync(False)
        yield
        model.set_requires_gradient_sync(True)
    return ctx


def _sharded(seed: int, mesh=None):
    import shardwise
    model = tiny_gpt(seq_len=SEQ, seed=seed)
    for block in model.blocks:
        shardwise.fully_shard(block, mesh=mesh)
    return shardwise.fully_shard(model, mesh=mesh)


def _clone(tree):
    if isinstance(tree, torch.Tensor):         # a DTensor stays one (its local tensor cloned)
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_clone(v) for v in tree)
    return tree


def portable(tree):
    """A state dict as the test's parent process can receive it: each DTensor as (its local tensor, its global
    shape, its placements), the rest as it is."""
    from torch.distributed.tensor import DTensor
    if isinstance(tree, DTensor):
        return ("DTensor", tree.to_local().detach().clone(), tuple(tree.shape), repr(tree.placements))
    if isinstance(tree, dict):
        return {k: portable(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(portable(v) for v in tree)
    return tree


def _refused(attempt) -> str:
    from shardwise.errors import UserError
    try:
        attempt()
    except UserError as e:
        return str(e)
    return "accepted"


def two_ranks() -> dict:
    """fully_shard vs FSDP2's full state dicts; a sharded round trip; FSDP1's and DDP's spellings; reports;
    refusals."""
    import shardwise
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    world = dist.group.WORLD
    out: dict = {}
    model = _sharded(1234)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    train(model, opt, batches()[:3], world)
    out["report"] = model.comm_report()
    sharding = model._fully_shard_state()
    # (gathered again in backward, bytes of each flat's shard): the root stays gathered, as FSDP2's does
    out["units"] = [(u.reshard_after_forward and not u.is_root, [f.shard.numel() * f.shard.element_size()
                                                                 for f in u.flats]) for u in sharding.runtime.units]
    out["full"] = _clone(shardwise.get_state_dict(model, opt, full_state_dict=True))
    out["rank0"] = shardwise.get_state_dict(model, opt, full_state_dict=True, cpu_offload=True)

    peer = tiny_gpt(seq_len=SEQ, seed=1234)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in peer.blocks:
        torch_fully_shard(block, mesh=mesh)
    torch_fully_shard(peer, mesh=mesh)
    peer_opt = torch.optim.AdamW(peer.parameters(), **ADAMW)
    train(peer, peer_opt, batches()[:3], world)
    out["fsdp2"] = get_state_dict(peer, peer_opt, options=StateDictOptions(full_state_dict=True))

    # sharded: saved, loaded into a fresh model and optimizer, saved again; both then take one more step
    saved = _clone(shardwise.get_state_dict(model, opt))
    fresh = _sharded(99)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1.0)
    shardwise.set_state_dict(fresh, fresh_opt, model_state_dict=saved[0], optim_state_dict=saved[1])
    out["sharded"] = portable((saved, _clone(shardwise.get_state_dict(fresh, fresh_opt))))
    out["next"] = (train(model, opt, batches()[3:4], world), train(fresh, fresh_opt, batches()[3:4], world))
    accumulate(model, opt, batches()[4], grad_sync_off(model))     # step 4: two forwards, one reduce-scatter
    out["accumulated"], out["step 3"] = model.comm_report(), model.comm_report(step=3)
    with torch.no_grad():                                             # step 5: an evaluation forward
        model(*lm_pair(batches()[5][:2]))
    out["evaluated"] = model.comm_report()

    # FSDP1's spelling on the same training: full, named, on the CPU on every rank; loaded back in a fresh one
    fsdp = shardwise.FullyShardedDataParallel(tiny_gpt(seq_len=SEQ, seed=1234))
    fsdp_opt = torch.optim.AdamW(fsdp.parameters(), **ADAMW)
    train(fsdp, fsdp_opt, batches()[:3], world)
    out["fsdp_report"] = fsdp.comm_report()
    fsdp1 = shardwise.FullyShardedDataParallel.optim_state_dict(fsdp, fsdp_opt)
    again = shardwise.FullyShardedDataParallel(tiny_gpt(seq_len=SEQ, seed=5))
    again_opt = torch.optim.AdamW(again.parameters(), lr=1.0)
    again_opt.load_state_dict(shardwise.FullyShardedDataParallel.optim_state_dict_to_load(again, again_opt, fsdp1))
    out["fsdp1"] = (fsdp1, shardwise.FullyShardedDataParallel.optim_state_dict(again, again_opt))

    # DDP: the same functions, replicated state, the unwrapped model's names
    ddp = shardwise.DistributedDataParallel(tiny_gpt(seq_len=SEQ, seed=1234), bucket_cap_mb=0.01)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    train(ddp, ddp_opt, batches()[:3], world)
    out["ddp_report"], out["ddp_buckets"] = ddp.comm_report(), len(ddp.reducer.buckets)
    out["ddp_impl"] = ddp.reducer.impl.value          # the default, 'auto': shared memory on this host
    ddp_sd = _clone(shardwise.get_state_dict(ddp, ddp_opt, full_state_dict=True))
    out["ddp_report_after_save"] = ddp.comm_report()                 # replicated: saving communicates nothing
    accumulate(ddp, ddp_opt, batches()[3], ddp.no_sync)
    out["ddp_accumulated"] = ddp.comm_report()
    ddp2 = shardwise.DistributedDataParallel(tiny_gpt(seq_len=SEQ, seed=8), bucket_cap_mb=0.01)
    ddp2_opt = torch.optim.SGD(ddp2.parameters(), lr=1.0)
    shardwise.set_state_dict(ddp2, ddp2_opt, model_state_dict=ddp_sd[0], optim_state_dict=ddp_sd[1],
                             full_state_dict=True)
    out["ddp"] = (ddp_sd, _clone(shardwise.get_state_dict(ddp2, ddp2_opt, full_state_dict=True)))

    # refused, one line naming the key: another model's state dict, a missing key, a sharded one at a new size
    msd, osd = out["full"]
    bigger = tiny_gpt(seq_len=SEQ, n_layer=3).state_dict()
    lacking = {k: v for k, v in msd.items() if k != "head.norm.bias"}
    osd_lacking = {"state": osd["state"], "param_groups": [
        {**g, "params": [n for n in g["params"] if n != "blocks.1.mlp.fc_in.weight"]} for g in osd["param_groups"]]}
    wide = _clone(osd)
    wide["state"]["embed.tok.weight"]["exp_avg"] = torch.zeros(256, 48)
    kw = dict(full_state_dict=True)
    out["refusals"] = [
        _refused(lambda: shardwise.set_state_dict(model, opt, model_state_dict=bigger, optim_state_dict=None, **kw)),
        _refused(lambda: shardwise.set_state_dict(model, opt, model_state_dict=lacking, optim_state_dict=None, **kw)),
        _refused(lambda: shardwise.set_state_dict(model, opt, model_state_dict=None, optim_state_dict=osd_lacking,
                                                  **kw)),
        _refused(lambda: shardwise.set_state_dict(model, opt, model_state_dict=None, optim_state_dict=wide, **kw)),
        _refused(lambda: shardwise.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=None)),
        _refused(lambda: shardwise.get_state_dict(model.blocks[0], opt)),
        _refused(lambda: shardwise.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=None,
                                                  broadcast_from_rank0=True)),
    ]
    return out


def check_two_ranks(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        (msd, osd), (peer_msd, peer_osd) = r["full"], r["fsdp2"]
        assert_state_close(msd, peer_msd, what=f"model vs FSDP2, rank {rank}", adam=True)
        assert osd["param_groups"] == peer_osd["param_groups"], (osd["param_groups"], peer_osd["param_groups"])
        assert osd["state"].keys() == peer_osd["state"].keys()
        for fqn, state in peer_osd["state"].items():
            assert state.keys() == osd["state"][fqn].keys(), (fqn, state.keys())
            for key, value in state.items():
                torch.testing.assert_close(osd["state"][fqn][key], value, rtol=1e-5, atol=0.0,
                                           msg=lambda m, f=fqn, k=key: f"optimizer {f} {k} vs FSDP2: {m}")
        rank0_msd, rank0_osd = r["rank0"]
        if rank == 0:
            assert_state_close(rank0_msd, msd, what="cpu_offload model", rtol=0, atol=0)
            _assert_equal(rank0_osd, osd, "cpu_offload optimizer")
        else:
            assert rank0_msd == {} and rank0_osd == {}
        saved, loaded = r["sharded"]
        _assert_equal(loaded, saved, f"sharded round trip, rank {rank}")
        assert r["next"][0] == r["next"][1], r["next"]            # bitwise: the same state takes the same step
        fsdp1, fsdp1_again = r["fsdp1"]
        _assert_equal(fsdp1, osd, f"FSDP1 optim_state_dict vs get_state_dict, rank {rank}", rtol=1e-5)
        _assert_equal(fsdp1_again, fsdp1, f"FSDP1 optim_state_dict_to_load, rank {rank}")
        ddp_saved, ddp_loaded = r["ddp"]
        assert "embed.tok.weight" in ddp_saved[0] and "embed.tok.weight" in ddp_saved[1]["state"]
        _assert_equal(ddp_loaded, ddp_saved, f"DDP round trip, rank {rank}")
        _check_reports(r)
    expected = ['"blocks.2.', '"head.norm.bias"', '"blocks.1.mlp.fc_in.weight"',
                '"embed.tok.weight" "exp_avg" has shape (256, 48), its parameter (256, 32)', "full_state_dict=True",
                "get_state_dict: FSDPBlock is wrapped inside another fully_shard'ed module; pass the outermost",
                "broadcast_from_rank0=True sends whole tensors from rank 0; give full_state_dict=True"]
    refusals = results[0]["refusals"]
    assert len(refusals) == len(expected)
    for message, part in zip(refusals, expected):
        assert part in message and "\n" not in message, (part, message)
        assert message.startswith(("set_state_dict: ", "get_state_dict: ")), message


def _check_reports(r: dict) -> None:
    """One fully_shard step: every unit gathered in forward, those resharded after it again in backward, one
    reduce-scatter per flat; the ledger counts each as the whole buffer, dp x this rank's shard. DDP: one
    all-reduce per bucket (through shared memory: the default on one host)."""
    rows = {row["op"]: row for row in r["report"]}
    assert set(rows) == {"all_gather", "reduce_scatter"}, r["report"]
    forward = [2 * b for _, flats in r["units"] for b in flats]
    backward = [2 * b for again, flats in r["units"] if again for b in flats]
    gathers, scatters = rows["all_gather"], rows["reduce_scatter"]
    assert (gathers["count"], gathers["bytes"]) == (len(forward) + len(backward), sum(forward) + sum(backward)), \
        (r["report"], r["units"])
    assert (scatters["count"], scatters["bytes"]) == (len(forward), sum(forward)), (r["report"], r["units"])
    assert all(row["group"] == "dp" and row["group_size"] == 2 and row["seconds"] >= 0 for row in r["report"])
    # gradient accumulation: both forwards' gathers in one step, one reduce-scatter; the step before as it was
    counts = lambda rows: {row["op"]: (row["count"], row["bytes"]) for row in rows}  # noqa: E731
    assert counts(r["step 3"]) == counts(r["report"]), (r["step 3"], r["report"])
    assert counts(r["accumulated"]) == {"all_gather": (2 * gathers["count"], 2 * gathers["bytes"]),
                                        "reduce_scatter": (scatters["count"], scatters["bytes"])}, r["accumulated"]
    assert counts(r["fsdp_report"]) == counts(r["report"]), r["fsdp_report"]       # the same units
    forward_only = {"all_gather": (len(forward), sum(forward))}
    assert counts(r["evaluated"]) == forward_only, r["evaluated"]
    for report in ("ddp_report", "ddp_report_after_save", "ddp_accumulated"):
        (ddp,) = r[report]
        assert (ddp["op"], ddp["count"]) == ("shm_all_reduce", r["ddp_buckets"]), (report, ddp)
    assert r["ddp_impl"] == "shm"


def _assert_equal(actual, expected, what: str, rtol: float = 0.0) -> None:
    """Nested dicts / lists equal, tensors within rtol (0: bitwise)."""
    if isinstance(expected, torch.Tensor):
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=0.0, msg=lambda m: f"{what}: {m}")
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), (what, actual.keys(), expected.keys())
        for k in expected:
            _assert_equal(actual[k], expected[k], f"{what} [{k}]", rtol)
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), what
        for k, (a, e) in enumerate(zip(actual, expected)):
            _assert_equal(a, e, f"{what} [{k}]", rtol)
    else:
        assert actual == expected, (what, actual, expected)


def four_ranks() -> dict:
    """Ranks 0 and 1 train 3 steps, save the full state (rank 0 holds it) and go on for 3 more; then 4 ranks, one
    process alone (rank 3, a world of one) and an unwrapped model (rank 2) resume from the saved state."""
    import shardwise
    pair = dist.new_group([0, 1])
    solos = [dist.new_group([r]) for r in range(4)]        # every rank makes every group, in one order
    rank = dist.get_rank()
    out: dict = {}
    saved = [None]
    if rank < 2:
        model = _sharded(1234, mesh=pair)
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        train(model, opt, batches()[:3], pair)
        saved = [shardwise.get_state_dict(model, opt, full_state_dict=True, cpu_offload=True)]
        out["uninterrupted"] = {"losses": train(model, opt, batches()[3:], pair), "state": model.full_state_dict()}
    dist.broadcast_object_list(saved, src=0)
    msd, osd = saved[0]
    resumed = _sharded(77)                                  # other weights: only the loaded state may count
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1.0)        # the loaded param_groups set lr
    shardwise.set_state_dict(resumed, resumed_opt, model_state_dict=msd, optim_state_dict=osd, full_state_dict=True)
    out["four"] = {"losses": train(resumed, resumed_opt, batches()[3:], dist.group.WORLD),
                   "state": resumed.full_state_dict()}
    # only rank 0 gives the state (as if it alone read the file); it sends it to the others
    sent = _sharded(76)
    sent_opt = torch.optim.AdamW(sent.parameters(), lr=1.0)
    given = (msd, osd) if rank == 0 else ({}, {})
    shardwise.set_state_dict(sent, sent_opt, model_state_dict=given[0], optim_state_dict=given[1],
                             full_state_dict=True, broadcast_from_rank0=True)
    out["from_rank0"] = {"losses": train(sent, sent_opt, batches()[3:], dist.group.WORLD),
                         "state": sent.full_state_dict()}
    if rank == 3:
        alone = _sharded(78, mesh=solos[3])
    elif rank == 2:
        alone = tiny_gpt(seq_len=SEQ, seed=79)
    if rank >= 2:
        alone_opt = torch.optim.AdamW(alone.parameters(), lr=1.0)
        shardwise.set_state_dict(alone, alone_opt, model_state_dict=msd, optim_state_dict=osd, full_state_dict=True)
        out["alone"] = {"losses": train(alone, alone_opt, batches()[3:]),
                        "state": alone.full_state_dict() if rank == 3 else alone.state_dict()}
    return out


def check_four_ranks(results: list[dict]) -> None:
    reference = results[0]["uninterrupted"]
    for rank, r in enumerate(results):
        runs = {"4 ranks": r["four"], "4 ranks, sent from rank 0": r["from_rank0"],
                **({"alone": r["alone"]} if "alone" in r else {})}
        for name, run in runs.items():
            what = f"resumed at {name} (rank {rank}) vs 2 ranks uninterrupted"
            assert_close_lists(run["losses"], reference["losses"], rtol=1e-5, what=what)
            assert_state_close(run["state"], reference["state"], what=what, adam=True)
