"""Start this node's ranks through torch.distributed.run (torchrun's elastic agent), on one node or many.

`nanotitan train` with no torchrun around it calls `launch_local`, which re-executes
`python -m nanotitan.cli train ...` once per rank under torchrun's agent: output of every rank streamed
with a `[rankN]:` prefix, the other ranks stopped when one fails, and `train.max_restarts` restarts of the
whole group (ranks then resume from the newest complete checkpoint when `train.resume=auto`).

- One machine: a standalone c10d rendezvous, `dp*pp*ep` ranks (what `torchrun --standalone` does).
- Slurm: under `srun --ntasks-per-node 1` (one task per node, no torchrun), each task is its node's agent.
  `slurm_rendezvous` reads Slurm's variables and points every node at the same c10d rendezvous: the first
  node of the step's node list as endpoint, port MASTER_PORT (or one derived from the job id, the same on
  every node), the job id as rendezvous id. So `srun --nodes 2 --ntasks-per-node 1 nanotitan train ...` is the
  whole recipe (examples/slurm.sbatch).
"""

from __future__ import annotations

import itertools
import os
import re
import sys
import zlib
from dataclasses import dataclass

from .config import ConfigError


def under_torchrun(env=os.environ) -> bool:
    return "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env)


@dataclass(frozen=True)
class Rendezvous:
    """Where this node's agent meets the others: `nnodes` agents of `nproc_per_node` ranks each."""
    nnodes: int
    node_rank: int  # this node's index in the node list (node 0 hosts the rendezvous store)
    nproc_per_node: int
    endpoint: str  # host:port of the c10d rendezvous
    run_id: str

    def torchrun_args(self) -> list[str]:
        return [f"--nnodes={self.nnodes}", f"--nproc-per-node={self.nproc_per_node}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.run_id}",
                # the host is node 0 by rank, not by matching its hostname against the endpoint's
                f"--rdzv-conf=is_host={1 if self.node_rank == 0 else 0}"]


def expand_nodelist(spec: str) -> list[str]:
    """Slurm's compressed host list -> host names, in order.

    "node[01-03],gpu7" -> node01 node02 node03 gpu7; "rack[1-2]-n[1,3]" -> rack1-n1 rack1-n3 rack2-n1 rack2-n3
    (zero padding kept: [08-10] -> 08 09 10).
    """
    hosts = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", spec):  # split on commas outside brackets
        parts = re.split(r"\[([^\]]*)\]", item)  # text, ranges, text, ranges, ..., text
        choices = []
        for i, part in enumerate(parts):
            if i % 2 == 0:
                choices.append([part])
                continue
            values = []
            for rng in part.split(","):
                lo, _, hi = rng.partition("-")
                if not lo.isdigit() or (hi and not hi.isdigit()):
                    raise ConfigError(f"cannot read the Slurm node list {spec!r} (bad range {rng!r})")
                width = len(lo) if lo.startswith("0") else 0
                values += [str(n).zfill(width) for n in range(int(lo), int(hi or lo) + 1)]
            choices.append(values)
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    return hosts


def slurm_rendezvous(world_size: int, env=os.environ) -> Rendezvous | None:
    """The rendezvous for this node when running as an `srun` task without torchrun, else None.

    One task per node: each starts world_size / nodes ranks. A multi-node allocation outside srun (the batch
    script itself, an salloc shell) is refused: the other nodes would never join."""
    nnodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    if "SLURM_JOB_ID" not in env or under_torchrun(env):
        return None
    if "SLURM_STEP_ID" not in env:  # srun sets it; the batch script and salloc shells do not
        if nnodes > 1:
            raise ConfigError(f"SLURM_NNODES={nnodes} but not inside srun: start the job with "
                              "`srun --ntasks-per-node 1 nanotitan train ...` (see examples/slurm.sbatch)")
        return None
    ntasks = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or nnodes)
    per_node = env.get("SLURM_NTASKS_PER_NODE", "1")
    if ntasks != nnodes or per_node != "1":
        raise ConfigError(f"srun started {ntasks} tasks on {nnodes} nodes (SLURM_NTASKS_PER_NODE={per_node}): "
                          "use `srun --ntasks-per-node 1`, nanotitan starts each node's ranks itself")
    if nnodes == 1:
        return None  # one node: the standalone launch
    if world_size % nnodes:
        raise ConfigError(f"parallel.dp*pp*ep = {world_size} ranks do not split evenly over {nnodes} Slurm nodes "
                          f"(choose a layout whose product is a multiple of {nnodes}, or srun --nodes N)")
    nproc = world_size // nnodes
    gpus = env.get("SLURM_GPUS_ON_NODE")
    if gpus and gpus.isdigit() and 0 < int(gpus) < nproc:
        raise ConfigError(f"{nproc} ranks per node but SLURM_GPUS_ON_NODE={gpus} (request --gpus-per-node {nproc}, "
                          f"or a layout of {int(gpus) * nnodes} ranks)")
    nodes = expand_nodelist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                            or env.get("SLURM_NODELIST", ""))
    if len(nodes) != nnodes:
        raise ConfigError(f"Slurm node list {nodes} does not have SLURM_NNODES={nnodes} nodes")
    job = env["SLURM_JOB_ID"]
    # The same port on every node without talking: MASTER_PORT, or one derived from the job id.
    port = int(env.get("MASTER_PORT") or 20000 + (int(job) if job.isdigit() else zlib.crc32(job.encode())) % 20000)
    return Rendezvous(nnodes=nnodes, node_rank=int(env.get("SLURM_NODEID", 0)), nproc_per_node=nproc,
                      endpoint=f"{nodes[0]}:{port}", run_id=f"nanotitan-{job}-{env['SLURM_STEP_ID']}")


def launch_local(nproc: int, argv: list[str], max_restarts: int = 0, rdzv: Rendezvous | None = None) -> int:
    """Run `nanotitan train <argv>` on `nproc` ranks of this machine (standalone), or as one node of
    `rdzv`; returns the exit code (0 = all ranks ok)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    os.environ.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank${rank}]:")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    where = ["--standalone", f"--nproc-per-node={nproc}"] if rdzv is None else rdzv.torchrun_args()
    args = get_args_parser().parse_args([
        *where, f"--max-restarts={max_restarts}",
        "--tee=3", "--monitor-interval=0.5", "-m", "nanotitan.cli", "train", *argv,
    ])
    try:
        run(args)
    except ChildFailedError as e:
        failures = ", ".join(f"rank {r}: exit {f.exitcode}" for r, f in sorted(e.failures.items()))
        print(f"nanotitan: training failed ({failures}); the other ranks were stopped", file=sys.stderr)
        return 1
    return 0
