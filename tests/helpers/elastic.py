"""Elastic test helpers: loopback "nodes" (one `nanotitan train --elastic.*` command each), their coordinator
and agents, and what the tests read back from them."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.equivalence import B, LR, base_args, layout_args
from tests.helpers.mp import free_port

K = 5  # elastic.snapshot_every: a failure loses at most K steps
# A job the test's events end (`end_by_notice`), not a step count a slow joiner's imports could outlast: its
# train.steps, never reached, and a constant LR after warmup, so the single-process reference's schedule is the job's
# whatever step it ends at.
LONG = 1000
CONSTANT = ("--train.lr_schedule", "constant")

AGENT_TIMEOUT_S = 400


def _agent(args: list[str], log, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "nanotitan.cli", "train", *args], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            # one code id for all nodes: a commit landing between two agents' starts is not a new version
                            env=dict(os.environ, OMP_NUM_THREADS="1", NANOTITAN_CODE_ID="test", **(env or {})))


def _records(run) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def _kill_ranks(agent: subprocess.Popen) -> None:
    """kill -9 every child process of an agent (its ranks), leaving the agent itself alive."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == agent.pid:
                os.kill(int(stat.parent.name), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass  # gone meanwhile


def _changes(run) -> list[dict]:
    path = run / "elastic.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []


def _await(what: str, cond, agents, logs, timeout_s: float = 240.0) -> None:
    """Poll until cond() holds; fail with every agent's output if one exits first or time runs out."""
    end = time.monotonic() + timeout_s
    while not cond():
        ended = [i for i, a in enumerate(agents) if a.poll() is not None]
        if ended or time.monotonic() > end:
            out = "\n".join(f"--- agent {i} ---\n{p.read_text()}" for i, p in enumerate(logs))
            pytest.fail(f"waiting for {what}: agents {ended} exited / timed out\n{out}")
        time.sleep(0.1)


def elastic_args(corpus_dir, run, tmp_path, steps: int, nodes: str, job: str) -> list[str]:
    """One loopback node's command line: one rank per node, a snapshot every K steps under tmp_path/shm."""
    return base_args(corpus_dir, run) + [
        "--train.steps", str(steps), "--train.global_batch", str(B), "--parallel.auto", "true",
        "--parallel.timeout_s", "60", "--elastic.nodes", nodes, "--elastic.nproc_per_node", "1",
        "--elastic.endpoint", f"127.0.0.1:{free_port()}", "--elastic.id", job,
        "--elastic.join_timeout_s", "120", "--elastic.snapshot_every", str(K),
        "--elastic.snapshot_dir", str(tmp_path / "shm"), "--train.max_restarts", "1"]


def end_by_notice(agents: list[subprocess.Popen], run, logs, after: int) -> int:
    """Once the job has logged step `after`, a notice (SIGTERM) to node 0's agent, agents[0]: it hosts the store,
    so the job ends after the stop's checkpoint. Waits for every agent; returns the last step. (Only node 0 is
    watched while it waits: a node that got a notice before may still be on its way out; how each agent ended is
    the caller's to assert.)"""
    _await(f"step {after}", lambda: _records(run)[-1]["step"] >= after, agents[:1], logs)
    agents[0].send_signal(signal.SIGTERM)
    for a in agents:
        a.wait(timeout=AGENT_TIMEOUT_S)
    return max(r["step"] for r in _records(run))


def losses_match_one_process(corpus_dir, tmp_path, run, steps: int, extra=()):
    """Every step 1..steps logged, each loss (replays included) the single process's (base_args + `extra`, the
    elastic job's model and data flags); returns that reference Trainer and the logged steps."""
    from nanotitan.config.config import load_config
    from nanotitan.train import Trainer

    torch.set_num_threads(1)
    ref = Trainer(load_config(None, base_args(corpus_dir, tmp_path / "ref") + layout_args(1, 1, 1)
                              + ["--train.steps", str(steps), *extra]))
    full = {r["step"]: r["loss"] for r in ref.train()["history"]}
    logged = [r["step"] for r in _records(run)]
    assert sorted(set(logged)) == list(range(1, steps + 1)), logged
    for r in _records(run):
        assert abs(r["loss"] - full[r["step"]]) <= 1e-5 * abs(full[r["step"]]), (r["step"], r["loss"], full[r["step"]])
    return ref, logged


def _coordinator(corpus_dir, run_dir, nodes: str, extra=()):
    from nanotitan.config.config import load_config
    from nanotitan.run.loopback import loopback_store
    from nanotitan.elastic.auth import SignedStore, new_launch
    from nanotitan.elastic.coordinator import Coordinator, job_hash

    cfg = load_config(None, base_args(corpus_dir, run_dir) + [
        "--train.global_batch", str(B), "--parallel.auto", "true", "--elastic.nodes", nodes,
        "--elastic.endpoint", "127.0.0.1:1", "--elastic.id", "bad", "--elastic.snapshot_dir", str(run_dir / "shm"),
        *extra])
    raw = loopback_store(timeout_s=10)  # torch's own TCPStore server would listen on every interface
    store = SignedStore(raw, b"k" * 32, "bad", new_launch())
    return Coordinator(cfg, store, job_hash(cfg)), store, raw


def _register(coord, store, node: int, hash_: str) -> None:
    """Node `node` registers as its agent does: node 0 is the coordinator's own; a joiner asks for its id
    (agent.ask_to_join, on a store client of its own) while the coordinator reads the requests. Then its first
    beat and node/I, with the launch's nonce that node 0's answer carried."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from nanotitan.elastic.agent import ask_to_join
    from nanotitan.elastic.auth import SignedStore

    if node:
        client = dist.TCPStore("127.0.0.1", store.store.underlying_store.port, is_master=False,
                               wait_for_workers=False, timeout=timedelta(seconds=10))
        store = SignedStore(client, store.key, store.prefix.rsplit("/", 1)[1])
        got = []
        asker = threading.Thread(target=lambda: got.append(ask_to_join(store, {"host": "h", "pid": 0, "hash": hash_},
                                                                        10, "test")))
        asker.start()
        while asker.is_alive():
            coord._registrations()
            asker.join(0.05)
        assert got == [node], got
    store.set(f"beat/{node}", str(time.time()))
    store.set(f"node/{node}", json.dumps({"host": "h", "pid": 0, "hash": hash_}))


def reap(agents: list[subprocess.Popen], files, logs) -> str:
    """The agents' end (a `finally:`): any still running killed with its ranks, the logs closed; their output."""
    for a in agents:
        if a.poll() is None:
            os.killpg(a.pid, signal.SIGKILL)
            a.wait()
    for f in files:
        f.close()
    return "\n".join(f"--- agent {i} ---\n{p.read_text()}" for i, p in enumerate(logs))


def final_params_match(corpus_dir, tmp_path, run, ref, steps: int, extra=()) -> None:
    """The job's final checkpoint, loaded into one process (base_args + `extra`), holds the reference's parameters."""
    from nanotitan.config.config import load_config
    from nanotitan.train import Trainer

    final = Trainer(load_config(None, base_args(corpus_dir, tmp_path / "load") + layout_args(1, 1, 1) + list(extra)
                                + ["--train.steps", str(steps), "--train.resume", str(run / "checkpoints" / f"step_{steps}")]))
    assert final.start_step == steps
    want = dict(ref.model.named_parameters())
    for name, t in final.model.named_parameters():
        torch.testing.assert_close(t, want[name], rtol=1e-4, atol=1e-3 * LR * steps, msg=lambda s: f"{name}: {s}")


def agent_logs(tmp_path, n: int):
    """The log paths of n agents, and their open files."""
    logs = [tmp_path / f"agent{i}.log" for i in range(n)]
    return logs, [open(p, "w") for p in logs]


def start_host(args: list[str], agents: list, files, logs) -> None:
    """Node 0's agent (the first to bind the endpoint hosts the store), once it hosts the store."""
    agents.append(_agent(args, files[0]))
    _await("node 0's store", lambda: "hosting the store" in logs[0].read_text(), agents, logs)


def leftovers(tmp_path) -> list[str]:
    """What an elastic job left behind under tmp_path: snapshot dirs (tmp_path/shm/nanotitan-UID/*) and the agents'
    temp dirs (tmp_path/tmp, their $TMPDIR when started with env=agent_tmp(tmp_path))."""
    shm, tmp = tmp_path / "shm" / f"nanotitan-{os.getuid()}", tmp_path / "tmp"
    return sorted([str(p) for p in shm.iterdir()] if shm.is_dir() else []) + sorted(
        str(p) for p in (tmp.iterdir() if tmp.is_dir() else []) if not p.name.startswith("torchinductor_"))  # torch's cache


def agent_tmp(tmp_path) -> dict:
    """An agent's environment with $TMPDIR under tmp_path (its temp dirs then show in `leftovers`)."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return {"TMPDIR": str(tmp_path / "tmp")}
