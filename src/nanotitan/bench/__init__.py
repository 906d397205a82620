"""`nanotitan bench NAME`: the benchmarks, each a module with `main(argv) -> int` (cli.py's BENCHES lists them).

    dp.py             our bucketed Reducer and ZeRO levels vs torch DDP vs one process, DP=2
    pp.py             pipeline step time, bubble and activation memory per schedule, vs torch.distributed.pipelining
    ep.py             one MoE layer under EP against its controls
    seed_ep_naive.py  the seed's EP layer, its loops as written (ep.py's comparison; not used in training)
    precision.py      bf16 vs fp32: bytes on the wire per axis, step time and where the non-GEMM time goes
    layouts.py        every DP x PP x EP layout of N ranks at equal tokens per step (the seed's experiment), under
                      torchrun; its run files are what the planner is calibrated and scored on
    emulate.py        the network emulator (parallel/comm/emulate.py) measured against its own link model
    overlap.py        parallel.ep_overlap against the same EP job without it, emulated and not, and the planner's price
    gpu.py            the MoE step at real shapes on one GPU: loop / grouped / compiled / nn.Linear (`make gpu-check`)
    compile.py        train.compile: eager vs compiled blocks, side by side
    tp.py             tensor parallel: ours vs torch's parallelize_module, SP's activation bytes, TP2 vs DP2
    cp.py             context parallel attention: causal balance, ring overlap under the emulator, ours vs an
                      all-gather-KV baseline, one process and torch's context_parallel
    placement.py      experts placed by load (parallel.expert_placement) against the static placement and the
                      capacity-capped router, side by side, under the network emulator
    dispatch.py       parallel.ep_dispatch static against dynamic, side by side, under the network emulator: padded
                      bytes, step time, EP wait, replays
    packed.py         document-masked attention (SDPA per document) against causal SDPA, side by side
    cp_docs.py        CP over packed documents: the balanced split against zigzag, attention work and time per rank

One-off experiments that are not commands (the planner's fits, call profiles, side-by-side runs of two trees) live
outside the package, in scripts/experiments/.
"""
