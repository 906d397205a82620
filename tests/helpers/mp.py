"""The multi-rank test harness is the package's own: `run_ranks(fn, world, args=(...), timeout=...)` runs
fn(rank, world, *args) on `world` gloo processes (see nanotitan/run/spawn.py). `train_once` is what every rank of
an equivalence test runs: the real trainer, end to end."""

import socket

from nanotitan.run import spawn

__all__ = ["run_ranks", "free_port", "train_once"]

# The ranks fork from one server process that imported these once (started at the first launch, it lives as long
# as pytest): a spawned rank re-imports torch and the trainer, ~2.5 s of CPU each, ~11 s for 8 ranks on 2 cores.
PRELOAD = ["pytest", "nanotitan.train", "nanotitan.parallel.dp.fsdp", "nanotitan.verify.world", "tests.helpers.mp",
           "tests.helpers.whole_state"]


def run_ranks(fn, world: int, args: tuple = (), timeout: float = 120.0, **kw) -> list:
    """nanotitan.run.spawn.run_ranks, the ranks forked from the preloaded server."""
    spawn.start_forkserver(PRELOAD)
    return spawn.run_ranks(fn, world, args, timeout, start_method="forkserver", **kw)


def free_port() -> int:
    """A port free right now, for launchers that need one up front (torchrun's --rdzv-endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def outputs_of(procs: list, timeout_s: float) -> list[str]:
    """Each Popen's combined output once it has exited (timeout_s each); any still running after that is killed,
    so a test never leaves a hung process behind."""
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout_s)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def train_once(args: list[str]) -> dict:
    """Train with `nanotitan train`'s Trainer on CLI-style args. Returns "records" (the logged step records:
    rank 0's, empty elsewhere) and their "losses", this rank's full "params" as {name: (tensor, first expert
    index for an expert shard, else None)} at any zero level (put together from every rank's checkpoint pieces,
    helpers/whole_state.py), each one's TP "parts" ((dim, rank, n) of a TP slice, else None), its MoE layers'
    router "biases" (with model.bias_update_rate > 0) and its (dp, pp, ep) "coords"."""
    from nanotitan.config.config import load_config
    from nanotitan.model.transformer import is_expert_param
    from nanotitan.parallel.tp import tp_part
    from nanotitan.train import Trainer
    from tests.helpers.whole_state import whole_state

    trainer = Trainer(load_config(None, args))
    try:
        records = trainer.train()["history"]
        full, _ = whole_state(trainer.shard.sync)  # collective: every rank calls it
        start = trainer.shard.spec.expert_start
        params = {n: (t.detach().clone(), start if is_expert_param(n) else None) for n, t in full.items()}
        live = dict(trainer.shard.model.named_parameters())
        parts = {n: tp_part(live[n]) for n in full}
        biases = {k: b.moe.router_bias.clone() for k, b in trainer.model.layers.items()
                  if b.is_moe and b.moe.router_bias is not None}  # model.bias_update_rate > 0 only
    finally:
        trainer.shard.close()  # drop a DDP wrapper before the process group goes
    return {"records": records, "losses": [r["loss"] for r in records], "params": params, "biases": biases,
            "coords": trainer.dims.coords(), "parts": parts}
