"""`nanotitan bench gpu`: the MoE step at real shapes on one GPU (`make gpu-check` runs it).

    nanotitan bench gpu [--shape mixtral|tiny] [--layers 2] [--seq 4096] [--steps 8] [--configs ...]
                        [--compile-backend inductor] [--peak-tflops X] [--json PATH] [--fp8 rowwise|tensorwise|mxfp8]
                        [--cuda-graphs]

A Mixtral-8x7B-shaped model cut to fit one GPU (d 4096, 32 heads / 8 kv heads, expert hidden 14336, 8 experts top-2,
vocab 32000, seq 4096, micro batch 1; fp32 weights and AdamW, the forward under bf16 autocast as train.dtype=bf16)
in five configurations: `reference` (each expert three plain nn.Linear, run one after another: torch's own
per-expert code), `loop` and `grouped` (model.experts_impl), and both again with every block compiled
(`+compile`: torch.compile per block, as train.compile does; the bench compiles the blocks itself, so it does not
wait for the Trainer's switch). Per configuration it prints MFU by our FLOP count (transformer.flops_per_token),
tokens/s, peak memory, host syncs per step (CUDA: torch.cuda.set_sync_debug_mode's warnings) and the time split of
one layer's parts, each timed alone forward + backward at the step's shapes (attention, router, dispatch,
experts, combine) times the layers, and the optimizer step; `other` is what the step takes beyond their sum
(embedding, head and loss, norms, Python). Before timing, the grouped experts are checked against the loop on
the device (max relative difference of one layer's output and expert weight gradients): a GPU kernel that
disagreed would show here first.

--fp8 adds `loop+fp8` (train.fp8 at that recipe, docs/fp8.md: torchao's float8 linears, our FP8 expert GEMMs,
one `torch._scaled_grouped_mm` launch each on a GPU; at mxfp8 torchao's MXFP8 linears and grouped expert GEMM; the
default fp8_skip): its MFU is against the same bf16 peak, so FP8's gain shows as MFU above `loop`'s.

--cuda-graphs (CUDA only) adds `grouped+graphs` and `loop+graphs`: the +compile rows with every block compiled in
inductor's mode "reduce-overhead" (train.cuda_graphs: each graph's forward and backward recorded once as a CUDA graph,
replayed every step, a step mark before each). The grouped row's MoE has no host read on one GPU (the grouped kernel's
offsets stay on the device), so its blocks can be whole graphs; the loop row's MoE reads its split sizes (a graph
break), so it runs between two captured graphs. Their `syncs` column says what is left on the host.

Without CUDA (or with --shape tiny) the same code runs at tiny shapes: tests/bench/test_bench_gpu.py runs it in the
suite, so it cannot rot. CPU figures mean nothing for a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config.config import ModelConfig
from ..config.fp8_rules import FP8_SKIP
from ..model import fp8 as float8
from ..model.moe import combine, pack_expert_major
from ..model.transformer import Transformer, flops_per_token, num_moe_layers
from ..observe.metrics import device_peak_flops

SHAPES = {
    "mixtral": dict(d_model=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336, num_experts=8, top_k=2, vocab_size=32000),
    "tiny": dict(d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=48, num_experts=4, top_k=2, vocab_size=256),
}
CONFIGS = ("reference", "loop", "grouped", "loop+compile", "grouped+compile")
FP8_CONFIGS = ("loop+fp8",)  # with --fp8 RECIPE (FP8 experts run the per-expert loop: docs/fp8.md)
GRAPH_CONFIGS = ("grouped+graphs", "loop+graphs")  # with --cuda-graphs, CUDA only


class LinearExperts(nn.Module):
    """The reference: each expert gate/up/down as plain nn.Linear (weights [out, in]), one expert after another on
    its rows (host split sizes, as the loop). Same function as ExpertFFN, from the same weights."""
    impl = "reference"

    def __init__(self, experts: nn.Module):
        super().__init__()
        L, D, Fh = experts.W_gate.shape
        self.gate, self.up, self.down = (nn.ModuleList(nn.Linear(i, o, bias=False) for _ in range(L))
                                         for i, o in ((D, Fh), (D, Fh), (Fh, D)))
        with torch.no_grad():
            for l in range(L):
                self.gate[l].weight.copy_(experts.W_gate[l].t())
                self.up[l].weight.copy_(experts.W_val[l].t())
                self.down[l].weight.copy_(experts.W_out[l].t())

    def grouped(self, x) -> bool:
        return False

    def forward(self, x_ND, counts_L, trip=None):
        counts = counts_L.tolist() if isinstance(counts_L, torch.Tensor) else counts_L
        ys = [d(F.silu(g(x)) * u(x)) for x, g, u, d in zip(x_ND.split(counts), self.gate, self.up, self.down)]
        return torch.cat(ys)


def build(shape: str, layers: int, seq: int, config: str, device: torch.device, backend: str,
          fp8: str = "off") -> Transformer:
    impl = config.split("+")[0]
    cfg = ModelConfig(**SHAPES[shape], n_layers=layers, max_seq_len=seq,
                      experts_impl="loop" if impl == "reference" else impl)
    model = Transformer(cfg).to(device)
    if config.endswith("+fp8"):
        float8.convert(model, float8.recipe(fp8), FP8_SKIP)
    if impl == "reference":
        for moe in model.moe_layers():
            moe.experts = LinearExperts(moe.experts).to(device)
    if config.endswith("+compile"):
        for block in model.layers.values():
            block.compile(backend=backend)  # in place: names and attributes as before (train.compile's unit)
    if config.endswith("+graphs"):  # train.cuda_graphs' unit: a block's graphs recorded as CUDA graphs
        for block in model.layers.values():
            block.compile(mode="reduce-overhead")
    return model.train()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds of fn() over reps calls (after one warm call), the device drained around each."""
    fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _autocast(device: torch.device, dtype: torch.dtype):
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def train_step(model: Transformer, opt, x, y, device, dtype):
    if device.type == "cuda":  # CUDA graph trees (the +graphs rows): the previous step's graph outputs are dead
        torch.compiler.cudagraph_mark_step_begin()
    with _autocast(device, dtype):
        ce, aux = model(x, y)
    (ce + 0.01 * aux).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def count_syncs(fn, device: torch.device) -> int | None:
    """Host syncs in fn() on CUDA (set_sync_debug_mode's warnings); None elsewhere (tests/parallel/test_syncs.py counts
    them on CPU by op)."""
    if device.type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def split(model: Transformer, opt, x, device, dtype, reps: int) -> dict:
    """Seconds per step of each part, timed alone forward + backward at the step's shapes: one layer's part
    times the MoE layers (attention: all layers), and one optimizer step."""
    block = next(b for b in model.layers.values() if b.is_moe)
    block = getattr(block, "_orig_mod", block)
    moe, cfg = block.moe, model.cfg
    B, S = x.shape
    with torch.no_grad(), _autocast(device, dtype):
        h = model.tok_emb(x).float()
    rope = (model.rope_cos, model.rope_sin)
    h.requires_grad_(True)
    h_TD = block.ffn_norm(h).detach().reshape(B * S, -1).requires_grad_(True)

    def attention():
        with _autocast(device, dtype):
            out = block.attn(block.attn_norm(h), rope)
        out.backward(torch.ones_like(out))

    with _autocast(device, dtype):
        ids, w, _ = moe.route(h_TD.detach(), B, S)
    order, tok, counts = pack_expert_major(ids, cfg.num_experts)
    x_ND = h_TD.detach().index_select(0, tok).to(dtype).requires_grad_(True)
    with _autocast(device, dtype):
        y_ND = moe.experts(x_ND.detach(), counts).detach().requires_grad_(True)
    w_N = w.reshape(-1).index_select(0, order).detach().to(dtype).requires_grad_(True)

    def router():
        with _autocast(device, dtype):
            _, wt, aux = moe.route(h_TD, B, S)
        (wt.sum() + aux).backward()

    def dispatch():
        o, t, _ = pack_expert_major(ids, cfg.num_experts)
        h_TD.index_select(0, t).sum().backward()

    def experts():
        with _autocast(device, dtype):
            out = moe.experts(x_ND, counts)
        out.backward(torch.ones_like(out))

    def combine_():
        out = combine(y_ND, w_N, tok, B * S)
        out.backward(torch.ones_like(out))

    n_moe, n = num_moe_layers(cfg), cfg.n_layers
    parts = {"attention": n * timed(attention, device, reps), "router": n_moe * timed(router, device, reps),
             "dispatch": n_moe * timed(dispatch, device, reps), "experts": n_moe * timed(experts, device, reps),
             "combine": n_moe * timed(combine_, device, reps)}
    opt.zero_grad(set_to_none=False)  # every parameter has a gradient: the step's full work
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    parts["optimizer"] = timed(opt.step, device, reps)
    opt.zero_grad(set_to_none=True)
    return parts


def grouped_vs_loop(shape: str, seq: int, device: torch.device, dtype: torch.dtype) -> float:
    """Max relative difference, grouped against loop, of one MoE layer's output and its experts' weight gradients
    (the grouped backward's 2D x 2D GEMMs), on this device and dtype."""
    outs = []
    for impl in ("loop", "grouped"):
        model = build(shape, 1, seq, impl, device, "eager")
        x = torch.randn(1, seq, model.cfg.d_model, generator=torch.Generator().manual_seed(0)).to(device)
        moe = model.layers["0"].moe
        with _autocast(device, dtype):
            y = moe(x)[0].float()
        y.square().mean().backward()
        outs.append([y.detach()] + [p.grad for p in moe.experts.parameters()])
        del model, moe
    return max(((g - r).abs().max() / r.abs().max()).item() for g, r in zip(outs[1], outs[0]))


def run_config(args, config: str, device: torch.device, dtype: torch.dtype, peak: float) -> dict:
    torch.manual_seed(0)
    model = build(args.shape, args.layers, args.seq, config, device, args.compile_backend, args.fp8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    g = torch.Generator().manual_seed(0)
    V = model.cfg.vocab_size
    x, y = (torch.randint(0, V, (1, args.seq), generator=g).to(device) for _ in range(2))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    train_step(model, opt, x, y, device, dtype)  # warm: the first call compiles
    _sync(device)
    first_s = time.perf_counter() - t0
    syncs = count_syncs(lambda: train_step(model, opt, x, y, device, dtype), device)
    step_s = timed(lambda: train_step(model, opt, x, y, device, dtype), device, args.steps)
    peak_mem = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    parts = split(model, opt, x, device, dtype, max(2, args.steps // 2))
    parts["other"] = max(0.0, step_s - sum(parts.values()))
    tokens = args.seq
    mfu = flops_per_token(model.cfg, args.seq) * tokens / step_s / peak
    return {"config": config, "step_s": step_s, "first_step_s": first_s, "tokens_per_s": tokens / step_s,
            "mfu": mfu, "peak_mem_gib": None if peak_mem is None else peak_mem / 2**30, "syncs": syncs,
            "split_s": parts}


def experts_micro(spec: str, device: torch.device, repeats: int) -> str:
    """--experts D,F,L,T,K: ExpertFFN alone, forward + backward, loop against grouped, fp32 and bf16 autocast, on
    T*K rows routed uniformly at random; round-robin, CPU seconds of this thread on CPU (a shared machine slows
    them less than wall time), wall time drained on CUDA. The measurement behind model.experts_impl "auto"."""
    from ..model.moe import ExpertFFN, expert_counts
    D, Fh, L, T, K = (int(v) for v in spec.split(","))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, L, (T * K,), generator=g)
    counts = expert_counts(ids, L).to(device)
    clock = time.thread_time if device.type == "cpu" else time.perf_counter
    lines = [f"ExpertFFN D={D} F={Fh} L={L} rows={T * K} ({device.type}, {torch.get_num_threads()} thread(s)): "
             "forward + backward seconds, min / median of " + str(repeats)]
    for dtype in (torch.float32, torch.bfloat16):
        mods = {impl: ExpertFFN(L, D, Fh, impl).to(device) for impl in ("loop", "grouped")}
        for m in mods.values():
            for w in m.parameters():
                nn.init.normal_(w, std=0.02, generator=torch.Generator().manual_seed(1))
        x = torch.randn(T * K, D, generator=g).to(device).requires_grad_(True)
        times: dict[str, list[float]] = {k: [] for k in mods}
        for r in range(repeats + 1):
            for impl, m in mods.items():
                _sync(device)
                t0 = clock()
                with _autocast(device, dtype):
                    y = m(x, counts)
                y.float().square().sum().backward()
                _sync(device)
                if r:  # the first round warms up
                    times[impl].append(clock() - t0)
        lo, gr = (sorted(times[k]) for k in ("loop", "grouped"))
        lines.append(f"  {str(dtype).split('.')[-1]:<9} loop {lo[0]:.4f} / {statistics.median(lo):.4f}   grouped "
                     f"{gr[0]:.4f} / {statistics.median(gr):.4f}   grouped/loop (median) "
                     f"{statistics.median(gr) / statistics.median(lo):.2f}")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    parts = list(rows[0]["split_s"]) if rows else []
    head = f"{'config':<16} {'MFU':>7} {'tok/s':>10} {'step s':>8} {'1st s':>7} {'peak GiB':>8} {'syncs':>5}  " + \
        " ".join(f"{p:>9}" for p in parts)
    lines = [head]
    for r in rows:
        mem = "n/a" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.1f}"
        syncs = "n/a" if r["syncs"] is None else str(r["syncs"])
        lines.append(f"{r['config']:<16} {100 * r['mfu']:>6.2f}% {r['tokens_per_s']:>10,.0f} {r['step_s']:>8.3f} "
                     f"{r['first_step_s']:>7.1f} {mem:>8} {syncs:>5}  "
                     + " ".join(f"{r['split_s'][p]:>9.4f}" for p in parts))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nanotitan bench gpu", description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=tuple(SHAPES), default=None, help="mixtral on CUDA, tiny elsewhere")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=None, help="tokens per step (one sequence): 4096, tiny 16")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per configuration (median)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the +compile rows")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="the MFU's peak (default: the device's)")
    ap.add_argument("--json", default="", help="also write the rows here")
    ap.add_argument("--experts", default="", metavar="D,F,L,T,K", help="only ExpertFFN, loop vs grouped, at this "
                    "shape (MID: 256,512,8,1024,2)")
    ap.add_argument("--repeats", type=int, default=20, help="rounds of --experts")
    ap.add_argument("--fp8", choices=("off", *float8.RECIPES), default="off", help=f"also {', '.join(FP8_CONFIGS)} "
                    "at this recipe (docs/fp8.md)")
    ap.add_argument("--cuda-graphs", action="store_true", help=f"also {', '.join(GRAPH_CONFIGS)} (CUDA only)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.cuda_graphs and device.type != "cuda":
        raise SystemExit("bench gpu --cuda-graphs: CUDA graphs are recorded on a CUDA stream, and no CUDA device is "
                         "visible (drop --cuda-graphs)")
    if args.experts:
        print(experts_micro(args.experts, device, args.repeats))
        return 0
    args.shape = args.shape or ("mixtral" if device.type == "cuda" else "tiny")
    args.seq = args.seq or (4096 if args.shape == "mixtral" else 16)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    peak = args.peak_tflops * 1e12 or device_peak_flops(device, args.dtype, torch.get_num_threads())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"bench gpu: {name} | torch {torch.__version__} | shape {args.shape} x {args.layers} layers, seq "
          f"{args.seq}, {args.dtype} | peak {peak / 1e12:.1f} TFLOP/s", flush=True)
    diff = grouped_vs_loop(args.shape, args.seq, device, dtype)
    print(f"grouped vs loop, one MoE layer (output, weight gradients): max rel diff {diff:.2e}", flush=True)
    rows = []
    configs = args.configs.split(",") + (list(FP8_CONFIGS) if args.fp8 != "off" else []) + \
        (list(GRAPH_CONFIGS) if args.cuda_graphs else [])
    for config in configs:
        assert config in CONFIGS + FP8_CONFIGS + GRAPH_CONFIGS, \
            f"--configs: {config!r} is not one of {CONFIGS} (+fp8: --fp8, +graphs: --cuda-graphs)"
        rows.append(run_config(args, config, device, dtype, peak))  # its model and optimizer freed on return
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"  {config}: {rows[-1]['step_s']:.3f} s/step", flush=True)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
