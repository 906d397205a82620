"""One rank of an elastic generation (agent.py starts it): the Trainer, plus what the agents need to know.

Each generation is a fixed world with a fixed layout. Its ranks are `nanotitan train` processes (started ahead by
their node's agent: `cli.warm_rank`) with the planned layout and `--train.resume PATH`, the newest checkpoint or
snapshot that verifies, which they load resharded onto that layout (checkpoint.py). What this adds to the plain
Trainer, all through the job's store on node 0:

- rank 0 polls `gen/G/stop` at each step boundary and turns it into the Trainer's stop request. agree_on_step's
  MAX all-reduce (train.ckpt_on_signal, which the agent sets) gives every rank the same verdict, so every rank
  finishes the step in flight, saves, and exits 0: the next generation continues from the next step.
- rank 0 publishes the last completed step (`gen/G/step`: the steps a failure loses are counted against it),
  the timings of its start after the first step (`gen/G/up`: the pause's parts), the stop's save (`gen/G/saved`)
  and how the generation ended (`gen/G/result`: finished or stopped).
- every elastic.snapshot_every steps, every rank snapshots its state (`ElasticTrainer.snapshot`): a copy to host
  memory at the step boundary, written to its node's snapshot dir on a thread while training goes on
  (snapshot.py). The stop's checkpoint and the end of the generation wait for the snapshot in flight, and the
  step after a snapshot counts (`gen/G/step`) only once that snapshot is on two nodes (SnapshotWriter.settle).
"""

from __future__ import annotations

import json
import os
import time
import zlib
from pathlib import Path

from ..state import checkpoint as ckpt
from ..config.config import Config
from ..parallel.comm import collectives as comm
from ..parallel.step import StepResult
from ..run.loopback import split_endpoint
from .auth import SignedStore, rank_key
from .snapshot import SnapshotWriter, private_root
from ..train import Trainer, run

RANK_ENV = "NANOTITAN_ELASTIC"  # set by the agent: {"endpoint", "id", "launch", "gen", "node", "spawned"} as JSON
WARM_ENV = "NANOTITAN_WARM_READY"  # a file a warm rank creates once it has imported


def snapshot_root(cfg: Config, node: int) -> Path:
    """Where node `node` of an elastic job keeps its snapshots (snapshot.py), one dir per job id, run dir and node.
    The node in the name gives each loopback "node" of one machine its own, as separate machines have. It sits in
    this user's own dir (snapshot.private_root: SNAPSHOT_DIR/nanotitan-UID/, mode 0700, checked)."""
    run = zlib.crc32(str(Path(cfg.run.dir).absolute()).encode())
    return private_root(cfg.elastic.snapshot_dir, f"elastic-{cfg.elastic.id}-{run:08x}-node{node}")


def job_store(endpoint: str, job: str, launch: str, timeout_s: float = 60.0) -> SignedStore:
    """A client of node 0's store, with this job's keys, signing and checking entries with the key and the launch
    nonce the agent handed this rank (auth.py)."""
    from datetime import timedelta

    import torch.distributed as dist

    host, port = split_endpoint(endpoint)
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    return SignedStore(store, rank_key(), job, launch)


class ElasticTrainer(Trainer):
    """The Trainer with a step-boundary poll (rank 0) and timings of its start; the training is the Trainer's."""

    def __init__(self, cfg: Config, store, gen: int, node: int, started: float):
        self.store, self.gen, self.started, self.entered = store, gen, started, time.time()
        self.load_s = self.save_s = 0.0
        super().__init__(cfg)
        nodes = comm.world_size() // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        self.snapshots = SnapshotWriter(self.cfg, snapshot_root(cfg, node), node, gen,
                                        leader=int(os.environ.get("LOCAL_RANK", 0)) == 0,
                                        timeout_s=self.cfg.parallel.timeout_s, peers=nodes > 1)
        self.built = time.time()

    def resume(self, where: str):
        t0 = time.perf_counter()
        super().resume(where)
        self.load_s = time.perf_counter() - t0

    def save(self, step: int):
        t0 = time.perf_counter()
        self.snapshots.wait()  # the stop's checkpoint (and the last) follows the snapshot in flight
        super().save(step)
        self.save_s = time.perf_counter() - t0
        if self.is_main and self.stop_requested:
            self.store.set(f"gen/{self.gen}/saved", json.dumps({"step": step, "save_s": self.save_s, "t": time.time()}))

    def train_step(self, step: int) -> StepResult:
        if self.is_main and self.store.get(f"gen/{self.gen}/stop") is not None:
            self.request_stop("elastic coordinator: a node joins or leaves")  # agree_on_step all-reduces it
        out = super().train_step(step)
        self.snapshots.settle()  # the last snapshot on a second node before this step counts: at most K lost
        stop = out.stop  # the agreed flag: rank 0's own stop_requested may be ahead of the others'
        k = self.cfg.elastic.snapshot_every
        if k and (step + 1) % k == 0 and not stop and step + 1 < self.cfg.train.steps:
            self.snapshot(step + 1)
        if self.is_main:
            self.store.set(f"gen/{self.gen}/step", str(step + 1))
            if step == self.start_step:
                self.store.set(f"gen/{self.gen}/up", json.dumps({
                    "start_step": self.start_step, "layout": layout_line(self.cfg), "started": self.started,
                    "entered": self.entered, "built": self.built, "load_s": self.load_s, "up": time.time()}))
        return out

    def snapshot(self, step: int) -> None:
        """Every elastic.snapshot_every steps: the state after `step`, into memory that outlives this process
        (tmpfs) and, through the agents, a peer node's; a failure restarts from it and loses at most K steps.
        Costs the copy to host memory here; the write runs on a thread (snapshot.py)."""
        self.snapshots.start(step, self.model, self.optimizer, self.shard, ckpt.layout_dict(self.dims), step * self.B)

    def close(self, failed: bool = False):
        if not failed:  # the snapshot's thread is in collectives of its own: finish them before the groups go
            self.snapshots.wait()
            if self.snapshots.count:
                self.log(f"nanotitan elastic: rank 0: {self.snapshots.summary()}")
        super().close(failed)


def layout_line(cfg: Config) -> str:
    p = cfg.parallel
    return (f"dp={p.dp} pp={p.pp} ep={p.ep} tp={p.tp} cp={p.cp} M={p.microbatches} m={cfg.train.micro_batch} "
            f"zero={p.zero}")  # tp, cp: the planner may choose them for a new world (plan/tp.py, plan/cp.py)


def run_rank(cfg: Config) -> dict:
    """train.run for a rank of an elastic generation: trains until the end or the coordinator's stop."""
    info = json.loads(os.environ[RANK_ENV])
    store = job_store(info["endpoint"], info["id"], info["launch"], cfg.parallel.timeout_s)
    trainer = ElasticTrainer(cfg, store, info["gen"], info["node"], info["spawned"])
    out = run(cfg, trainer)
    if trainer.is_main:
        store.set(f"gen/{info['gen']}/result", "stopped" if out["stopped"] else "finished")
    return out
