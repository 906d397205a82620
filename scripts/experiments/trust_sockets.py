"""Probe (issue 49, item 1): the listening TCP sockets of one-host jobs, and which of them another machine could
reach. Three jobs on this machine, each listed while it trains:
  train    `nanotitan train` on 2 ranks (run/launch.py: torchrun's standalone launch)
  elastic  a loopback elastic job, 1 node of 2 ranks (elastic/agent.py)
  spawn    run/spawn.run_ranks on 2 gloo ranks (the tests' and benchmarks' launcher)

    PYTHONPATH=src:. python scripts/experiments/trust_sockets.py          # the tree under test
    PYTHONPATH=/work/main/src:. python scripts/experiments/trust_sockets.py   # another tree's code
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.conftest import make_corpus
from tests.elastic.sockets import beyond_loopback, kill_tree, listening, rank_envs

TINY = ["--data.vocab_size", "300", "--model.d_model", "32", "--model.n_heads", "4", "--model.ffn_dim", "48",
        "--model.n_layers", "2", "--model.num_experts", "4", "--train.seq_len", "16", "--train.micro_batch", "2",
        "--train.eval_every", "0", "--train.sample_tokens", "0", "--train.threads", "1", "--run.log_every", "1",
        "--run.progress", "false", "--run.tensorboard", "false", "--train.steps", "100000"]


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def watch(name: str, cmd: list[str], run: Path, ranks: int) -> dict:
    """Start `cmd`, wait until it logs a step, list the sockets of its tree, kill it."""
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1", NANOTITAN_CODE_ID="probe"))
    try:
        end = time.monotonic() + 300
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("loss") >= 2):
            if p.poll() is not None or time.monotonic() > end:
                raise SystemExit(f"{name}: ended ({p.returncode}) before a step")
            time.sleep(0.2)
        socks, outside, ifnames = listening(p.pid), beyond_loopback(p.pid), {e.get('GLOO_SOCKET_IFNAME') for e in rank_envs(p.pid)}
    finally:
        kill_tree(p.pid)
        p.wait()
    return {"job": name, "listening": len(socks), "beyond_loopback": [a for _, a in outside],
            "gloo_ifname": sorted(ifnames)}


def _rank(rank, world, parent):
    import torch.distributed as dist
    dist.barrier()
    out = (listening(parent), beyond_loopback(parent), os.environ.get("GLOO_SOCKET_IFNAME")) if rank == 0 else None
    dist.barrier()
    return out


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="trust-sockets-"))
    corpus = make_corpus(tmp / "corpus")
    rows = []
    base = [sys.executable, "-m", "nanotitan.cli", "train", "--data.source", str(corpus), *TINY]
    rows.append(watch("train", [*base, "--run.dir", str(tmp / "train"), "--parallel.dp", "2"], tmp / "train", 2))
    rows.append(watch("elastic", [*base, "--run.dir", str(tmp / "elastic"), "--parallel.auto", "true",
                                  "--train.global_batch", "4", "--elastic.nodes", "1", "--elastic.nproc_per_node", "2",
                                  "--elastic.endpoint", f"127.0.0.1:{_free_port()}", "--elastic.id", "probe",
                                  "--elastic.snapshot_dir", str(tmp / "shm")], tmp / "elastic", 2))
    from nanotitan.run.spawn import run_ranks
    socks, outside, ifname = run_ranks(_rank, 2, args=(os.getpid(),), timeout=120)[0]
    rows.append({"job": "spawn", "listening": len(socks), "beyond_loopback": [a for _, a in outside],
                 "gloo_ifname": ifname})
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
