"""One MoE layer's trips under parallel.ep_overlap, measured against the planner's formula, on 2 emulated nodes.

    .venv/bin/python scripts/experiments/ep_overlap_layer.py [--profile h800] [--d-model 1024] [--ffn 2048] [--tokens 512]
                                                    [--experts 8] [--top-k 2] [--groups 1 2 4] [--repeats 3]

Two gloo ranks, one per emulated node (every all-to-all crosses the inter-node link), dilation fixed to this CPU's
fp32 peak (as `parallel.emulate_dilation` 0 would); each rank holds E/2 experts and routes `--tokens` tokens, top-k,
balanced (each expert gets the same rows) or uniformly at random. Per group count n (1 = the one-trip path): the
EP wait of the layer's forward and of its backward (`comm_ep_wait_s`: calls + waits), median over repeats and
ranks, next to `plan.cost.ep_overlap_exposed` evaluated with the link's modelled trip time and latency and with the
experts' compute measured alone here. This isolates the layer: in training, routing skew between ranks and other
axes' traffic add to what a rank waits (docs/ep.md).
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from nanotitan.run.spawn import run_ranks


def _rank(rank, world, args):
    torch.set_num_threads(1)
    from nanotitan.config.config import load_config
    from nanotitan.model.moe import ExpertFFN
    from nanotitan.parallel.comm import collectives as comm, emulate
    from nanotitan.parallel.ep import EPDispatcher
    from nanotitan.parallel.placement import EPShard, identity

    cfg = load_config(None, ["--parallel.emulate", args.profile, "--parallel.emulate_node_size", "1",
                             "--parallel.emulate_dilation", str(args.dilation)])
    emulate.install(emulate.link_model(cfg, rank=rank))
    group = dist.new_group([0, 1])
    D, F, E, K, T = args.d_model, args.ffn, args.experts, args.top_k, args.tokens
    torch.manual_seed(0)
    experts = ExpertFFN(E // 2, D, F)
    for p in experts.parameters():
        torch.nn.init.normal_(p, 0, 0.02)
    out = {}
    for routing in ("balanced", "random"):
        gen = torch.Generator().manual_seed(rank)
        ids = (torch.stack([(torch.arange(T) + k * E // K) % E for k in range(K)], 1) if routing == "balanced" else
               torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]))
        w = torch.full((T, K), 1.0 / K)
        for _ in range(args.repeats):
            for n in args.groups:
                x = torch.randn(T, D, requires_grad=True)
                dist.barrier()
                comm.COMM.reset()
                y = EPDispatcher(EPShard(identity(E, 2), rank), group, n)(x, ids, w, experts, E)
                fwd = comm.COMM.wait_s["ep"]
                y.sum().backward()
                out.setdefault((routing, n), []).append((fwd, comm.COMM.wait_s["ep"] - fwd))
    x = torch.randn(T * K, D, requires_grad=True)  # the experts alone: balanced rows, forward then backward
    counts = [T * K // (E // 2) // 2 * 2] * (E // 2)
    t0 = time.perf_counter()
    y = experts(x[:sum(counts)], counts)
    t1 = time.perf_counter()
    y.sum().backward()
    out["compute"] = (t1 - t0, time.perf_counter() - t1)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="h800")
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from nanotitan.config.hardware import cpu_peak_flops, get_hardware
    from nanotitan.parallel.comm.emulate import emulated_peak_flops
    from nanotitan.plan.cost import ep_overlap_exposed

    hw = get_hardware(args.profile)
    args.dilation = cpu_peak_flops(1, "fp32") / emulated_peak_flops(hw, "fp32")
    res = run_ranks(_rank, 2, args=(args,), timeout=900)
    fwd_x = statistics.median(r["compute"][0] for r in res)
    bwd_x = statistics.median(r["compute"][1] for r in res)
    # the modelled trip: T*K rows of D fp32, half of them to the other node; latency per call (one peer)
    a2a = args.tokens * args.top_k * args.d_model * 4 / 2 / (hw.inter.a2a_bw * args.dilation)
    lat = hw.inter.latency_s / args.dilation
    print(f"{args.profile} across 2 nodes, dilation {args.dilation:.3g}: trip {a2a * 1e3:.0f} ms + {lat * 1e3:.0f} ms "
          f"latency per call; experts alone: forward {fwd_x * 1e3:.0f} ms, backward {bwd_x * 1e3:.0f} ms\n")
    print("| routing | groups | forward EP ms | model | backward EP ms | model |\n|---|---:|---:|---:|---:|---:|")
    for (routing, n) in [k for k in res[0] if k != "compute"]:
        f = statistics.median(v[0] for r in res for v in r[(routing, n)])
        b = statistics.median(v[1] for r in res for v in r[(routing, n)])
        if n == 1:
            mf = mb = 2 * (a2a + lat)
        else:
            mf = ep_overlap_exposed(a2a, lat, n, fwd_x)
            mb = ep_overlap_exposed(a2a, lat, n, bwd_x, bwd_x / 2 / n)
        print(f"| {routing} | {n} | {f * 1e3:.0f} | {(mf + lat) * 1e3:.0f} | {b * 1e3:.0f} | {mb * 1e3:.0f} |")


if __name__ == "__main__":
    main()
