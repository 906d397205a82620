"""`nanotitan bench {dp,pp,ep}`: the axis benchmarks, each a module with `main(argv) -> int`.

dp.py  our bucketed Reducer vs torch DDP vs one process, DP=2
pp.py  pipeline step time, bubble and activation memory per schedule, against torch.distributed.pipelining
ep.py  one MoE layer under EP against its controls (and seed_ep_naive.py, the seed's loops, for comparison)
emulate.py  the network emulator (parallel/comm/emulate.py) measured against its own link model, per layout and axis
(`nanotitan bench layouts` is nanotitan/bench/layouts.py: whole training runs under torchrun.)
"""
