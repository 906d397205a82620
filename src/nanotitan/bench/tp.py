"""`nanotitan bench tp`: tensor parallel measured side by side (docs/tp.md "Measured").

    nanotitan bench tp [--part torch sp layouts] [--config configs/mid.toml] [--repeats 7] [--steps 12]
                       [--emulate h100-sxm] [--layouts dp2 tp2 tp2_nosp dp2_tp2 tp4] [--out docs/experiments/tp.json]

    torch    ours (parallel/tp.py on our Transformer) against torch's own `parallelize_module` TP (ColwiseParallel,
             RowwiseParallel, SequenceParallel, loss_parallel) on a plain nn.Module of the same shapes, dense
             (every FFN a SwiGLU, what both split): forward + backward of one microbatch on 2 gloo ranks, the two
             interleaved repeat by repeat; min and median, and ours / torch's
    sp       saved activation bytes of one forward (every tensor autograd keeps, counted once per storage) of ours
             at TP2 with SP against without, beside the planner's activation bytes for the same two layouts
    layouts  `nanotitan train` on the config at TP2 against DP2 (same global batch, same maths), tokens/s and
             tensor bytes per rank; with --emulate PROFILE also under the network emulator, each beside the
             planner's step time for the emulated cluster (PlanOptions(links_idle=True), the CPU profile for
             compute: what `bench layouts` compares)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config.config import Config, ModelConfig, load_config
from ..model.transformer import Transformer
from ..config.hardware import get_hardware
from ..parallel.comm import emulate
from ..observe.runs import run_results
from ..parallel.dims import ParallelDims
from ..parallel.tp import apply_tp, tp_shard
from ..run.spawn import run_ranks

PARTS = ("torch", "sp", "layouts")


# --- the plain reference model, split by torch's own TP API ---------------------------------------------------

class _Attention(nn.Module):
    def __init__(self, D: int, H: int):
        super().__init__()
        self.Dh = D // H
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(D, D, bias=False)

    def forward(self, x):
        B, S, _ = x.shape
        q, k, v = (p(x).view(B, S, -1, self.Dh).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H/N, S, Dh): this rank's heads
        return self.o_proj(y.transpose(1, 2).reshape(B, S, -1))


class _MLP(nn.Module):
    def __init__(self, D: int, Fd: int):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(D, Fd, bias=False), nn.Linear(D, Fd, bias=False)
        self.down_proj = nn.Linear(Fd, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.attn_norm, self.ffn_norm = nn.RMSNorm(m.d_model, m.norm_eps), nn.RMSNorm(m.d_model, m.norm_eps)
        self.attn, self.mlp = _Attention(m.d_model, m.n_heads), _MLP(m.d_model, m.ffn_dim)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.ffn_norm(x))


class PlainGPT(nn.Module):
    """The reference: our dense Transformer's shapes (no rope: its cost is the same elementwise work in both)."""

    def __init__(self, m: ModelConfig, vocab: int):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, m.d_model)
        self.layers = nn.ModuleList(_Block(m) for _ in range(m.n_layers))
        self.norm, self.head = nn.RMSNorm(m.d_model, m.norm_eps), nn.Linear(m.d_model, vocab, bias=False)

    def forward(self, idx):
        x = self.tok_emb(idx)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


def torch_tp(model: PlainGPT, mesh, sp: bool) -> PlainGPT:
    """torchtitan's Llama plan: q/k/v and gate/up column-wise, o and down row-wise, norms sequence-parallel,
    the embedding row-wise (vocab-parallel), the head column-wise with its logits left sharded for loss_parallel."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    seq = Shard(1) if sp else Replicate()
    parallelize_module(model, mesh, {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        **({"norm": SequenceParallel()} if sp else {}),
        "head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)})
    for block in model.layers:
        plan = {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(), "attn.v_proj": ColwiseParallel(),
                "attn.o_proj": RowwiseParallel(output_layouts=seq), "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(output_layouts=seq)}
        if sp:
            plan |= {"attn_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                     "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                     "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))}
        parallelize_module(block, mesh, plan)
    return model


def dense(m: ModelConfig) -> ModelConfig:
    """The config's model with every FFN dense (a SwiGLU of ffn_dim), what both TP implementations split."""
    return dataclasses.replace(m, first_k_dense=m.n_layers)


def _saved_bytes(fn, params) -> tuple[int, object]:
    """(bytes of every activation autograd saves while fn() runs, each storage once, the `params`' own storages
    left out, what fn returned)."""
    seen: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in params}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in weights:
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def _side_by_side(rank: int, world: int, m: ModelConfig, vocab: int, B: int, S: int, repeats: int) -> dict:
    """One rank of the `torch` and `sp` parts: ours and torch's, fwd + bwd, interleaved; saved bytes per SP mode."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    torch.manual_seed(0)
    dims = ParallelDims(1, 1, 1, rank, tp=world).build_groups()
    mesh = init_device_mesh("cpu", (world,))
    idx = torch.randint(0, vocab, (B, S))
    tgt = torch.randint(0, vocab, (B, S))
    ours = {}
    for sp in (True, False):
        model = Transformer(m, tokens=tp_shard(dims, sp))
        apply_tp(model)
        ours[sp] = model
    ref = torch_tp(PlainGPT(m, vocab), mesh, sp=True)

    def step_ours(model=ours[True]):
        model.zero_grad(set_to_none=True)
        loss, _ = model(idx, tgt)
        loss.backward()

    def step_torch():
        ref.zero_grad(set_to_none=True)
        with loss_parallel():
            loss = F.cross_entropy(ref(idx).flatten(0, 1), tgt.flatten())
            loss.backward()

    times = {"ours": [], "torch": []}
    for i in range(repeats + 2):  # 2 warm-ups; each repeat times both, in alternating order
        for name, fn in (("ours", step_ours), ("torch", step_torch))[:: 1 if i % 2 else -1]:
            torch.distributed.barrier()
            t0 = time.perf_counter()
            fn()
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    saved = {}
    for sp, model in ours.items():
        n, out = _saved_bytes(lambda model=model: model(idx, tgt), model.parameters())
        out[0].backward()
        saved["sp" if sp else "no_sp"] = n
    # what the network emulator holds TP's calls for on an H100 node (undilated): the code's collectives, counted
    links, held = emulate.install(emulate.LinkModel(get_hardware("h100-sxm"), 8, 1.0, rank)), {}
    for sp, model in ours.items():
        before = links.modelled_s["tp"]
        model(idx, tgt)[0].backward()
        held["sp" if sp else "no_sp"] = links.modelled_s["tp"] - before
    emulate.install(None)
    return {"times": times, "saved": saved, "tp_link_s": held}


def side_by_side(cfg: Config, repeats: int, tp: int = 2) -> dict:
    """The `torch` and `sp` parts on `tp` gloo ranks, one thread each: rank 0's figures, and the planner's."""
    from ..plan import Layout, predict
    from ..plan.cost import build_context
    from ..plan.tp import stage_tp_time

    vocab = cfg.model.vocab_size or cfg.data.vocab_size
    m = dataclasses.replace(dense(cfg.model), vocab_size=vocab)
    B, S = cfg.train.micro_batch, cfg.train.seq_len
    res = run_ranks(_side_by_side, tp, (m, vocab, B, S, repeats), timeout=600)[0]
    t = res["times"]
    stats = {k: {"min_s": min(v), "median_s": statistics.median(v)} for k, v in t.items()}
    c = dataclasses.replace(cfg, model=m)
    planned, planned_link = {}, {}
    h100, lay = get_hardware("h100-sxm"), Layout(1, 1, 1, "1f1b", 1, B, 0, tp=tp)
    for sp in (True, False):
        c.parallel = dataclasses.replace(cfg.parallel, sp=sp)
        key = "sp" if sp else "no_sp"
        planned[key] = predict(c, lay, h100).mem_parts["activations"]
        ctx = build_context(c, lay, h100)
        planned_link[key] = stage_tp_time(ctx, ctx.stages[0])[1]
    return {"tp": tp, "shape": f"dense {m.n_layers}x d{m.d_model} h{m.n_heads} ffn{m.ffn_dim} V{vocab}, {B}x{S}",
            "repeats": repeats, "time": stats,
            "ours_over_torch": {k: stats["ours"][k] / stats["torch"][k] for k in ("min_s", "median_s")},
            "saved_bytes": res["saved"], "planned_act_bytes": planned,
            "tp_link_s": {"emulator": res["tp_link_s"], "planner": planned_link}}


# --- TP2 against DP2 with the trainer ---------------------------------------------------------------------------

def run_train(config: str, flags: list[str], steps: int, run_dir: Path, timeout: float) -> dict:
    """One `nanotitan train` job: the median step time and tokens/s of its second half, tensor bytes per rank."""
    args = [sys.executable, "-m", "nanotitan.cli", "train", "--config", config, *flags, "--train.steps", str(steps),
            "--run.dir", str(run_dir), "--run.log_every", "1", "--run.progress", "false", "--run.tensorboard",
            "false", "--train.eval_every", "0", "--train.sample_tokens", "0", "--train.ckpt_at_end", "false"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(flags)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    res = run_results(run_dir)
    recs, ranks = res["records"], res["ranks"]
    late = recs[len(recs) // 2:]
    keys = ("param_bytes", "grad_bytes", "optim_bytes", "act_peak_bytes")
    return {"step_s": statistics.median(x["step_time_s"] for x in late),
            "tokens_per_sec": statistics.median(x["tokens_per_sec"] for x in late),
            "final_loss": recs[-1]["loss"], "tensor_bytes": [{k: r.get(k) for k in keys} for r in ranks]}


def layout_flags(m: int) -> dict[str, list[str]]:
    """The layouts at the same tokens per step (m sequences): DP2's ranks take m/2 each, TP2's share m; the 4-rank
    ones (DP2·TP2 at m/2 per DP rank, TP4 sharing m) time-share the 2 cores as 8-rank `bench layouts` runs do."""
    return {"dp2": ["--parallel.dp", "2", "--train.micro_batch", str(m // 2)], "tp2": ["--parallel.tp", "2"],
            "tp2_nosp": ["--parallel.tp", "2", "--parallel.sp", "false"],
            "dp2_tp2": ["--parallel.dp", "2", "--parallel.tp", "2", "--train.micro_batch", str(m // 2)],
            "tp4": ["--parallel.tp", "4"]}


def layouts(config: str, steps: int, emulate: str, overrides: list[str], plain: bool = True,
            names: tuple[str, ...] = ("dp2", "tp2", "tp2_nosp")) -> dict:
    """TP2 against DP2 (and TP2 without SP), plain and, with `emulate`, under the network emulator beside the
    planner's step time for the emulated cluster."""
    from ..config.hardware import detect_hardware
    from ..parallel.comm import emulate as emu
    from ..plan import Layout, PlanOptions, predict
    from ..resolve import resolve_emulation, resolve_model

    out = {}
    for net in ("",) * plain + ((emulate,) if emulate else ()):
        extra = ["--parallel.emulate", net] if net else []
        if net:  # one dilation for every layout (the automatic one, computed once)
            cfg = resolve_emulation(resolve_model(load_config(config, overrides + extra)))
            extra += ["--parallel.emulate_dilation", str(cfg.parallel.emulate_dilation)]
            links = emu.link_model(cfg)
            hw = links.dilated(detect_hardware("cpu-gloo"))
        for name, flags in layout_flags(load_config(config, overrides).train.micro_batch).items():
            if name not in names:
                continue
            with tempfile.TemporaryDirectory() as d:
                row = run_train(config, overrides + flags + extra, steps, Path(d), timeout=1800)
            if net:
                c = load_config(config, overrides + flags)
                p = c.parallel
                lay = Layout(p.dp, p.pp, p.ep, p.schedule, p.microbatches, c.train.micro_batch, p.zero, tp=p.tp)
                pred = predict(c, lay, hw, PlanOptions(link_node_size=links.node_size, links_idle=True))
                row |= {"pred_step_s": pred.step_time_s, "pred_costs": pred.costs,
                        "err": pred.step_time_s / row["step_s"] - 1}
            out[f"{name}{'@' + net if net else ''}"] = row
            print(f"[bench tp] {name} {net or 'plain'}: {json.dumps(row)}", flush=True)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="nanotitan bench tp")
    ap.add_argument("--part", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--config", default="configs/mid.toml")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--emulate", default="", help="also run the layouts under this emulated network (a profile)")
    ap.add_argument("--emulated-only", action="store_true", help="with --emulate: skip the plain gloo runs")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    ap.add_argument("--layouts", nargs="+", default=["dp2", "tp2", "tp2_nosp"], choices=list(layout_flags(2)),
                    help="which layouts the layouts part runs")
    args, overrides = ap.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    res = {}
    if "torch" in args.part or "sp" in args.part:
        res["side_by_side"] = side_by_side(cfg, args.repeats)
        print(json.dumps(res["side_by_side"], indent=1), flush=True)
    if "layouts" in args.part:
        res["layouts"] = layouts(args.config, args.steps, args.emulate, overrides, not args.emulated_only,
                                 tuple(args.layouts))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0
