"""Host syncs of one training step, counted per layout (issue 42 item 2): a new one cannot slip in.

A sync is what makes the host wait for the device on CUDA: reading a value (`.item()`, `float()`, `bool()`,
`.tolist()`; aten._local_scalar_dense underneath all but tolist) or an op whose output shape depends on the data
(nonzero, masked_select, unique, bincount — CUDA reads max(ids) —, repeat_interleave without output_size). On CPU
none of them costs a wait, but they are the same calls: `SyncCounter` counts them by the nanotitan function that
made them (the innermost frame under src/nanotitan), during one unlogged, unmetered training step (step 2).
A device-to-host `.cpu()` / `.to("cpu")` is invisible on a CPU run (a no-op there); on a GPU,
torch.cuda.set_sync_debug_mode covers it (`nanotitan bench gpu`).

The documented counts (docs/moe.md, "Host syncs"), per rank, for the tiny 4-layer MoE of tests/helpers/equivalence.py
(every layer MoE, 4 microbatches of this rank per step):
- the MoE layers (router, dispatch, experts, capacity, combine): none with model.experts_impl grouped on one device;
  the loop reads its split sizes once per layer call; under EP one read per layer call (the all-to-all's split
  sizes), whatever the impl;
- the step's own: one, the finite check every rank agrees on (parallel/step.py agree_on_step).
"""

import sys
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.mp import run_ranks
from tests.helpers.equivalence import base_args, layout_args

aten = torch.ops.aten
# ops whose output shape depends on the data (a host read of a count on CUDA)
DATA_SHAPED = {aten.nonzero.default, aten.masked_select.default, aten.bincount.default, aten._unique2.default,
               aten.unique_dim.default, aten.unique_consecutive.default, aten._local_scalar_dense.default}


def _site() -> str:
    for frame in reversed(traceback.extract_stack()):
        # not a meter's mode (the step peak's dispatch mode, the host-sync meter's function mode)
        if "/nanotitan/" in frame.filename and frame.name not in ("__torch_dispatch__", "__torch_function__"):
            return frame.filename.split("/nanotitan/")[-1] + ":" + frame.name
    return "?"


class SyncCounter(TorchDispatchMode):
    """Counts syncs by site while entered (also `Tensor.tolist`, which never reaches the dispatcher)."""

    def __init__(self):
        super().__init__()
        self.sites = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in DATA_SHAPED or (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None):
            self.sites[_site() + ":" + func.__name__.split(".")[0]] += 1
        return func(*args, **kwargs)

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        counter = self

        def tolist(t):
            counter.sites[_site() + ":tolist"] += 1
            return counter._tolist(t)
        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


def count_step(args: list[str]) -> dict:
    """Syncs by site of the unlogged step 2 of a Trainer on `args` (steps 0 and 1 run first: the trainer's own meters,
    memory and host syncs (observe/host_syncs.py), meter them, and a step counted twice would count twice)."""
    from nanotitan.config.config import load_config
    from nanotitan.train import Trainer
    trainer = Trainer(load_config(None, args))
    try:
        trainer.train_step(0)
        trainer.train_step(1)
        with SyncCounter() as c:
            trainer.train_step(2)
    finally:
        trainer.shard.close()
    return dict(c.sites)


def _cases(rank, world, cases, corpus_dir, run_root):
    return [count_step(_args(corpus_dir, f"{run_root}/{world}_{i}", case)) for i, case in enumerate(cases)]


def _args(corpus_dir, run_dir, case):
    dp, pp, ep, impl, *extra = case
    return (base_args(corpus_dir, run_dir) + layout_args(dp, pp, ep)
            + ["--train.steps", "4", "--run.log_every", "100", "--train.ckpt_at_end", "false",
               "--model.experts_impl", impl, *extra])


CAP = ("--model.capacity_factor", "1.0")
STEP = {"parallel/step.py:agree_on_step:_local_scalar_dense": 1}  # the finite check every rank agrees on


def expected(calls: int, impl: str, ep: bool) -> dict:
    """The documented syncs of one step on a rank making `calls` MoE layer calls (docs/moe.md, "Host syncs")."""
    want = dict(STEP)
    if ep:
        want["parallel/ep.py:__call__:tolist"] = calls  # the all-to-all's split sizes: the one EP sync
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
