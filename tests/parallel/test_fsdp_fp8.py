"""parallel.fp8_comm under ZeRO-3 (parallel/dp/fp8_gather.py, docs/fp8.md "FP8 weights on the wire"): FSDP2
all-gathers each FP8 weight as its forward operand, cast on the shards with the whole weight's scales, and the GEMMs
read those bits. So zero 3 trains bitwise what zero 0 trains at the same flags (each rank's GEMMs take the bits one
process makes; the gradients' sums of two are exact): losses and parameters equal over 2 steps of AdamW, for both
recipes, with the experts sharded whole (Shard(0), their scales all-gathered) and cut along K (Shard(1), their
amax reduced over the group), and with the weights gathered again for the backward (zero3_reshard always).
The comm meter counts each forward's all-gathers: against the bf16 payload of the same weights, K + 1 bytes a row
(a column of an expert) at rowwise (the scale's exponent) and K a row plus a 4-byte scale or amax per weight (per
expert) at tensorwise."""

from __future__ import annotations

import pytest
import torch

from nanotitan.parallel.comm.collectives import COMM
from nanotitan.parallel.dims import ParallelDims
from tests.helpers.mp import run_ranks

pytest.importorskip("torchao")

D, F_HID, STEPS = 32, 48, 2
# (recipe, experts, zero3_reshard): 4 experts over 2 ranks are sharded whole, 3 along K
CASES = [("tensorwise", 4, "never"), ("rowwise", 4, "never"), ("tensorwise", 3, "always"), ("rowwise", 3, "always")]


def _models(rank: int, recipe: str, experts: int, dims: ParallelDims):
    from nanotitan.config.config import Config
    from nanotitan.config.fp8_rules import FP8_SKIP
    from nanotitan.model import fp8 as float8
    from nanotitan.model.transformer import Transformer
    from nanotitan.parallel.ep import apply_ep
    from nanotitan.parallel.placement import expert_shards
    from tests.helpers.specs import build_shard_spec

    cfg = Config()
    cfg.model.vocab_size, cfg.model.d_model, cfg.model.n_layers, cfg.model.n_heads = 64, D, 2, 2
    cfg.model.ffn_dim, cfg.model.num_experts, cfg.model.top_k, cfg.parallel.dp = F_HID, experts, 2, 2
    models = []
    for _ in range(3):  # zero 0, zero 3 with the FP8 all-gather, zero 3 gathering fp32 (the bytes' baseline)
        m = apply_ep(Transformer(cfg.model, build_shard_spec(cfg, 0, 0), seed=0, experts=expert_shards(cfg, dims)),
                     dims)
        float8.convert(m, float8.recipe(recipe, wire=True), FP8_SKIP)
        models.append(m)
    return models


def _case(rank: int, recipe: str, experts: int, reshard: str) -> dict:
    from nanotitan.model.transformer import is_expert_param
    from nanotitan.optim.adamw import AdamW, decay_groups
    from nanotitan.parallel.dp.fsdp import FSDPSync
    from nanotitan.parallel.dp.sync import ReplicatedSync
    from tests.helpers.whole_state import whole_state

    dims = ParallelDims(2, 1, 1, rank=rank).build_groups(timeout_s=60)
    a, b, c = _models(rank, recipe, experts, dims)

    def split(model):
        named = list(model.named_parameters())
        return [(n, p) for n, p in named if is_expert_param(n)], [(n, p) for n, p in named if not is_expert_param(n)]

    sync_a = ReplicatedSync(a, dims, *split(a), 0.002, 0.5)
    sync_b = FSDPSync(b, dims, *split(b), 0.002, 0.5, "full", reshard, torch.float32)
    sync_c = FSDPSync(c, dims, *split(c), 0.002, 0.5, "full", reshard)
    fp8_names = [n for n, m in b.named_modules() for q in ("weight", "W_gate", "W_val", "W_out")
                 if getattr(m, "fp8", None) is not None and q in m._parameters]
    shapes = {n: tuple(p.shape) for n, p in b.named_parameters()}
    shard_dims = {n: p.placements[0].dim for n, p in b.named_parameters() if hasattr(p, "placements")}
    opts = [AdamW(decay_groups(s.param_groups(), 0.1), lr=1e-2, fused=True) for s in (sync_a, sync_b, sync_c)]
    losses, nbytes = {"a": [], "b": []}, {}
    for step in range(STEPS):
        for key, model, sync, opt in (("a", a, sync_a, opts[0]), ("b", b, sync_b, opts[1]), ("c", c, sync_c, opts[2])):
            for mb in range(2):
                g = torch.Generator().manual_seed(1000 * rank + 10 * step + mb)
                tok = torch.randint(0, 64, (2, 17), generator=g)
                COMM.reset()
                ce, aux = model(tok[:, :-1], tok[:, 1:])
                if step == 0 and mb == 0:
                    nbytes[key] = COMM.bytes["dp"]  # the forward's all-gathers (and the FP8 casts' amax reductions)
                losses.setdefault(key, []).append(ce.item())
                sync.prepare(sync=mb == 1)
                ((ce + 0.01 * aux) / 2).backward()
            sync.finish()
            opt.step()
            sync.zero_grad()
    full_a = {n: p.detach().clone() for n, p in a.named_parameters()}
    full_b, _ = whole_state(sync_b)
    return {"losses": losses, "bytes": nbytes, "equal": [n for n in full_a if torch.equal(full_a[n], full_b[n])],
            "params": list(full_a), "fp8": fp8_names, "gathered": fp8_gather_names(b), "shapes": shapes,
            "shard_dims": shard_dims}


def fp8_gather_names(model) -> list[str]:
    """The parameters whose local shards carry the FP8 all-gather extension."""
    return [n for n, p in model.named_parameters() if hasattr(getattr(p, "_local_tensor", None), "fsdp_pre_all_gather")]


def _main(rank: int, world: int) -> list[dict]:
    return [_case(rank, *case) for case in CASES]


def _expected_bytes(recipe: str, res: dict) -> tuple[int, int]:
    """(the bytes fp8_gather.py sends for the FP8 weights in one forward, their bf16 payload): the bits, and the
    scales all-gathered where the shard keeps a scale's dims whole, else reduced: rowwise a byte each (the
    power-of-2 exponent, all-gathered or its MIN all-reduced), tensorwise 4 (the fp32 scale, or the amax)."""
    sent = bf16 = 0
    for n in res["gathered"]:
        shape = res["shapes"][n]
        numel = 1
        for k in shape:
            numel *= k
        bf16 += 2 * numel
        n_scales = numel // (shape[1] if recipe == "rowwise" else shape[-1] * shape[-2])
        sent += numel + n_scales * (1 if recipe == "rowwise" else 4)
    return sent, bf16


@pytest.mark.timeout(300)
def test_zero3_fp8_all_gather_is_zero0_and_halves_the_bytes():
    results = run_ranks(_main, world=2, timeout=280)
    for (recipe, experts, reshard), per_rank in zip(CASES, zip(*results)):
        name = f"{recipe} {experts} experts reshard {reshard}"
        for r, res in enumerate(per_rank):
            assert set(res["gathered"]) == {f"{m}.{q}" for m in res["fp8"] for q in ("weight", "W_gate", "W_val",
                                                                                     "W_out")
                                            if f"{m}.{q}" in res["shapes"]}, (name, res["gathered"])
            cut = {res["shard_dims"][n] for n in res["gathered"] if ".experts." in n}
            assert cut == {0 if experts == 4 else 1}, (name, cut)  # whole experts, or cut along K
            assert res["losses"]["b"] == res["losses"]["a"], (name, r, res["losses"])
            assert res["equal"] == res["params"], (name, r, sorted(set(res["params"]) - set(res["equal"])))
        res = per_rank[0]
        sent, bf16 = _expected_bytes(recipe, res)
        fp8_bytes = res["bytes"]["b"] - (res["bytes"]["c"] - 2 * bf16)  # the fp32 run gathers 4 bytes an element
        assert fp8_bytes == sent, (name, fp8_bytes, sent)
        ratio = fp8_bytes / bf16
        print(f"zero 3 FP8 all-gather, {name}: {fp8_bytes} bytes against {bf16} bf16 ({ratio:.4f}); "
              f"whole forward {res['bytes']['b']} against {res['bytes']['c']} fp32")
        assert ratio <= 0.55, (name, ratio)
