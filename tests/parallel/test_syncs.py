"""Host syncs of one training step, counted per layout and by site: a new one cannot slip in.

A sync is what makes the host wait for the device on CUDA: reading a value (`.item()`, `float()`, `bool()`,
`.tolist()`; aten._local_scalar_dense underneath all but tolist) or an op whose output shape depends on the data
(nonzero, masked_select, unique, bincount — CUDA reads max(ids) —, repeat_interleave without output_size), and a
device-to-host `.cpu()`. On CPU none of them costs a wait, but they are the same calls: the trainer's own meter
(observe/host_syncs.py `HostSyncs`, which counts only reads of device values: a `.tolist()` of counts already
copied to the host is free) counts them by the nanotitan function that made them, during one unlogged, unmetered
training step (step 2).

The documented counts (docs/moe.md, "Host syncs"), per rank, for the tiny 4-layer MoE of tests/helpers/equivalence.py
(every layer MoE, 4 microbatches of this rank per step):
- the MoE layers (router, dispatch, experts, capacity, combine): none with model.experts_impl grouped on one device;
  the loop reads its split sizes once per layer call; under EP one read per layer call (the all-to-all's split
  sizes), whatever the impl;
- the step's own: one, the finite check every rank agrees on (parallel/step.py agree_on_step).
"""

import sys

import torch

from nanotitan.observe.host_syncs import HostSyncs
from tests.helpers.mp import run_ranks
from tests.helpers.equivalence import base_args, layout_args


def count_step(args: list[str]) -> dict:
    """Syncs by site of the unlogged step 2 of a Trainer on `args` (steps 0 and 1 run first: the trainer's own meters,
    memory and host syncs (observe/host_syncs.py), meter them, and a step counted twice would count twice)."""
    from nanotitan.config.config import load_config
    from nanotitan.train import Trainer
    trainer = Trainer(load_config(None, args))
    try:
        trainer.train_step(0)
        trainer.train_step(1)
        with HostSyncs(torch.device("cpu")) as meter:
            trainer.train_step(2)
    finally:
        trainer.shard.close()
    return dict(meter.sites)


def _cases(rank, world, cases, corpus_dir, run_root):
    return [count_step(_args(corpus_dir, f"{run_root}/{world}_{i}", case)) for i, case in enumerate(cases)]


def _args(corpus_dir, run_dir, case):
    dp, pp, ep, impl, *extra = case
    return (base_args(corpus_dir, run_dir) + layout_args(dp, pp, ep)
            + ["--train.steps", "4", "--run.log_every", "100", "--run.peak_every", "10", "--train.ckpt_at_end", "false",
               "--model.experts_impl", impl, *extra])


CAP = ("--model.capacity_factor", "1.0")
STEP = {"parallel/step.py:agree_on_step:__bool__": 1}  # the finite check every rank agrees on


def expected(calls: int, impl: str, ep: bool) -> dict:
    """The documented syncs of one step on a rank making `calls` MoE layer calls (docs/moe.md, "Host syncs")."""
    want = dict(STEP)
    if ep:
        want["parallel/ep.py:__call__:cpu"] = calls  # the all-to-all's split sizes: the one EP sync
    elif impl == "loop":
        want["model/moe.py:__call__:tolist"] = calls  # the loop's split sizes
    return want


def test_syncs_one_process(corpus_dir, tmp_path):
    """One process, 4 MoE layers x 8 microbatches = 32 layer calls: the grouped experts sync nowhere (with capacity
    drops too), the loop once per call."""
    torch.set_num_threads(1)
    for i, case in enumerate([(1, 1, 1, "loop"), (1, 1, 1, "grouped"), (1, 1, 1, "grouped", *CAP)]):
        got = count_step(_args(corpus_dir, tmp_path / str(i), case))
        assert got == expected(32, case[3], ep=False), (case, got)


def test_syncs_ep(corpus_dir, tmp_path):
    """DP2·EP2 (4 layers x M=2 = 8 calls per rank) and PP2·EP2 (2 layers x M=4 = 8 calls per rank), loop and
    grouped, one 4-rank launch: exactly the one split-size read per layer call."""
    cases = [(2, 1, 2, "grouped"), (1, 2, 2, "loop"), (1, 2, 2, "grouped", *CAP)]
    results = run_ranks(_cases, 4, args=(cases, str(corpus_dir), str(tmp_path)), timeout=300, pg_timeout=120)
    for rank, per_case in enumerate(results):
        for case, got in zip(cases, per_case):
            assert got == expected(8, case[3], ep=True), (rank, case, got)


if __name__ == "__main__":  # print the table: python tests/parallel/test_syncs.py CORPUS_DIR
    print(count_step(_args(sys.argv[1], "/tmp/syncs_run", (1, 1, 1, sys.argv[2] if len(sys.argv) > 2 else "loop"))))
