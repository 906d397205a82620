"""Re-layout on the fly (issue 24) with loopback "nodes": each node is one `nanotitan train --elastic.*` command.

Two nodes start (world 2: dp=2), a third joins at about step 10 (world 3: pp=3), the second gets a SIGTERM notice
at about step 30 (world 2 again), the third's processes are killed (-9) at about step 52 (its agent stays), and the
job finishes at 70.
Planned changes lose nothing; the kill loses at most K = elastic.snapshot_every steps, replayed from the newest
snapshot. Every logged loss (replays included) and the final parameters equal an uninterrupted single-process run
at the same global batch (the equivalence rule, DESIGN §4)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.mp import free_port
from tests.test_equivalence import LR, B, base_args, layout_args

STEPS, K = 70, 5
AGENT_TIMEOUT_S = 400


def _agent(args: list[str], log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "nanotitan.cli", "train", *args], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            # one code id for all nodes: a commit landing between two agents' starts is not a new version
                            env=dict(os.environ, OMP_NUM_THREADS="1", NANOTITAN_CODE_ID="test"))


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


def _snapshot_steps(args, nodes) -> set[int]:
    """The steps of which every node in `nodes` holds its committed unit (snapshot.py)."""
    from nanotitan.elastic import snapshot
    from nanotitan.config.config import load_config
    from nanotitan.elastic.rank import snapshot_root

    cfg = load_config(None, args)
    held = [{int(snapshot.UNIT.match(u).group(1)) for u in snapshot.units(snapshot_root(cfg, n))} for n in nodes]
    return set.intersection(*held)


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


def losses_match_one_process(corpus_dir, tmp_path, run, steps: int):
    """Every step 1..steps logged, each loss (replays included) the single process's; returns that reference
    Trainer and the logged steps."""
    from nanotitan.config.config import load_config
    from nanotitan.train import Trainer

    torch.set_num_threads(1)
    ref = Trainer(load_config(None, base_args(corpus_dir, tmp_path / "ref") + layout_args(1, 1, 1)
                              + ["--train.steps", str(steps)]))
    full = {r["step"]: r["loss"] for r in ref.train()["history"]}
    logged = [r["step"] for r in _records(run)]
    assert sorted(set(logged)) == list(range(1, steps + 1)), logged
    for r in _records(run):
        assert abs(r["loss"] - full[r["step"]]) <= 1e-5 * abs(full[r["step"]]), (r["step"], r["loss"], full[r["step"]])
    return ref, logged


@pytest.mark.slow
def test_join_notice_and_kill(corpus_dir, tmp_path):
    from nanotitan.config.config import load_config
    from nanotitan.train import Trainer

    run = tmp_path / "elastic"
    # Paced by an emulated network (values unchanged): each rank a node, every collective held ~10 ms, so the
    # tiny model's 70 steps outlast the joiner's imports however fast this machine trains it.
    args = elastic_args(corpus_dir, run, tmp_path, STEPS, "2:3", "relayout") + [
        "--parallel.emulate", "h800", "--parallel.emulate_node_size", "1", "--parallel.emulate_dilation", "0.002"]
    logs = [tmp_path / f"agent{i}.log" for i in range(3)]
    files = [open(p, "w") for p in logs]
    agents: list[subprocess.Popen] = []
    try:
        agents.append(_agent(args, files[0]))  # node 0: the first to bind the endpoint hosts the store
        _await("node 0's store", lambda: "hosting the store" in logs[0].read_text(), agents, logs)
        agents.append(_agent(args, files[1]))
        _await("step 3", lambda: len(_records(run)) >= 3, agents, logs)
        agents.append(_agent(args, files[2]))  # joins once its warm ranks have imported (10-30 steps later here)
        _await("the join's re-layout", lambda: len(_changes(run)) >= 1, agents, logs)
        # Each later event waits a few steps past the previous change: the agents' warm ranks are ready again.
        at = max(30, min(_changes(run)[0]["step"] + 8, 45))
        _await(f"step {at}", lambda: _records(run)[-1]["step"] >= at, agents, logs)
        agents[1].send_signal(signal.SIGTERM)  # a preemption notice to node 1's agent
        _await("the notice's re-layout", lambda: len(_changes(run)) >= 2, agents[:1] + agents[2:], logs)
        at = max(52, min(_changes(run)[1]["step"] + 8, 60))
        _await(f"step {at}", lambda: _records(run)[-1]["step"] >= at, agents[:1] + agents[2:], logs)
        # A snapshot is written on a thread after its step: wait until both nodes hold one newer than the notice.
        since = _changes(run)[1]["step"]
        _await(f"a snapshot after step {since}", lambda: _snapshot_steps(args, (0, 2)) and
               max(_snapshot_steps(args, (0, 2))) > since, agents[:1] + agents[2:], logs)
        _kill_ranks(agents[2])  # node 2 loses its ranks (and warm ranks); its agent stays
        for a in agents:
            a.wait(timeout=AGENT_TIMEOUT_S)
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
        for f in files:
            f.close()
    out = "\n".join(f"--- agent {i} ---\n{p.read_text()}" for i, p in enumerate(logs))
    assert [a.returncode for a in agents] == [0, 0, 0], out

    # Two changes, each to the planner's layout for its world, nothing lost.
    changes = _changes(run)
    assert [(c["event"], c["nodes"]) for c in changes] == [("join", [2, 3]), ("notice", [3, 2]), ("failure", [2, 2])], out
    assert [c["new"].split(" M=")[0] for c in changes] == ["dp=1 pp=3 ep=1", "dp=2 pp=1 ep=1", "dp=2 pp=1 ep=1"], changes
    assert 3 <= changes[0]["step"] < changes[1]["step"] < changes[2]["step"] < STEPS, changes
    lost = changes[2]["steps_lost"]
    assert [c["steps_lost"] for c in changes[:2]] == [0, 0] and 0 <= lost <= K, changes
    assert changes[2]["step"] % K == 0, changes  # resumed from a snapshot

    # Every step logged, each loss the single process's; only the lost steps were run twice.
    ref, steps = losses_match_one_process(corpus_dir, tmp_path, run, STEPS)
    assert len(steps) - STEPS <= lost, steps

    # The final checkpoint, loaded into one process, holds the single process's parameters.
    final = Trainer(load_config(None, base_args(corpus_dir, tmp_path / "load") + layout_args(1, 1, 1)
                                + ["--train.steps", str(STEPS), "--train.resume", str(run / "checkpoints" / f"step_{STEPS}")]))
    assert final.start_step == STEPS
    want = dict(ref.model.named_parameters())
    for name, t in final.model.named_parameters():
        torch.testing.assert_close(t, want[name], rtol=1e-4, atol=1e-3 * LR * STEPS, msg=lambda s: f"{name}: {s}")


# --- bad cases, decided by node 0's coordinator (one process, a real store, no ranks) ---------------------------

def _coordinator(corpus_dir, run_dir, nodes: str, extra=()):
    from datetime import timedelta

    import torch.distributed as dist

    from nanotitan.config.config import load_config
    from nanotitan.elastic.auth import SignedStore
    from nanotitan.elastic.coordinator import Coordinator, job_hash

    cfg = load_config(None, base_args(corpus_dir, run_dir) + [
        "--train.global_batch", str(B), "--parallel.auto", "true", "--elastic.nodes", nodes,
        "--elastic.endpoint", "127.0.0.1:1", "--elastic.id", "bad", "--elastic.snapshot_dir", str(run_dir / "shm"),
        *extra])
    raw = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    store = SignedStore(dist.PrefixStore("nanotitan/elastic/bad", raw), b"k" * 32)
    return Coordinator(cfg, store, job_hash(cfg)), store, raw


def _register(store, node: int, hash_: str) -> None:
    assert store.add("joined", 1) - 1 == node
    store.set(f"beat/{node}", str(time.time()))
    store.set(f"node/{node}", json.dumps({"host": "h", "pid": 0, "hash": hash_}))


def test_world_without_layout_leaves_a_spare_and_a_different_joiner_is_refused(corpus_dir, tmp_path, capsys):
    """5 ranks admit no layout at batch 16 (4 experts, 4 layers): the newest node waits as a spare and the job
    starts on 4; a node with another code or config hash is refused in one line."""
    coord, store, _raw = _coordinator(corpus_dir, tmp_path, "1:8")
    for node in range(5):
        _register(store, node, coord.hash)
    _register(store, 5, "0" * 16)
    coord.since -= 1e6  # whatever the clock, the first generation is due now
    coord.tick()
    plan = json.loads(store.get("gen/1"))
    assert plan["members"] == [0, 1, 2, 3] and plan["layout"].startswith("dp=4 pp=1 ep=1"), plan
    out = capsys.readouterr().out
    assert "world 5 admits no layout (no layout of 5 ranks" in out and "node 4 waits as a spare" in out, out
    assert "node 5 (h) runs different code or config" in store.get("refused/5")


def test_a_snapshot_that_fails_its_checksum_is_skipped(corpus_dir, tmp_path, capsys):
    """The next generation resumes from the newest snapshot that verifies: a unit whose shard fails its checksum
    (and no other node holds a good copy) is named and passed over; the older one is assembled and chosen."""
    import shutil

    from nanotitan.config.config import load_config
    from nanotitan.elastic.rank import snapshot_root
    from nanotitan.train import Trainer

    torch.set_num_threads(1)
    Trainer(load_config(None, base_args(corpus_dir, tmp_path / "src") + layout_args(1, 1, 1)
                        + ["--train.steps", "4", "--train.ckpt_every", "2"])).train()
    coord, _store, _raw = _coordinator(corpus_dir, tmp_path / "run", "1")
    root = snapshot_root(coord.cfg, 0)
    for step in (2, 4):  # a one-rank checkpoint is one node's whole unit
        shutil.copytree(tmp_path / "src" / "checkpoints" / f"step_{step}", root / f"step_{step}" / "g1-node0")
    shard = next((root / "step_4" / "g1-node0").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    shard.write_bytes(bytes(data))
    assert coord._newest_checkpoint() == root / "checkpoints" / "step_2"
    out = capsys.readouterr().out
    assert "skipped snapshot step_4" in out and "fails its checksum" in out, out
