"""Re-layout on the fly (issue 24) with loopback "nodes": each node is one `nanotitan train --elastic.*` command.

Two nodes start (world 2: dp=2), a third joins (world 3: pp=3), the second gets a SIGTERM notice (world 2 again),
the third's processes are killed (-9) (its agent stays), and once that failure's generation trains, a notice to
node 0 ends the job after its stop's checkpoint; once under AdamW, once under Muon (issue 51 item 4: its momentum,
one buffer per matrix, moves with the re-layouts and the snapshot replay as AdamW's moments do). The test's events,
not a step count, set the job's length, and the third node, started early, joins when the test opens its gate
(a joiner's imports take from 10 to 60 steps here, with the machine's load).
Planned changes lose nothing; the kill loses at most K = elastic.snapshot_every steps, replayed from the newest
snapshot. Every logged loss (replays included) and the final parameters equal an uninterrupted single-process run
at the same global batch (the equivalence rule, DESIGN §4): a constant LR after warmup, so that run's schedule is
the job's whatever step the job ends at."""

import json
import re
import signal
import subprocess

import pytest
import torch

from nanotitan.elastic.agent import JOIN_GATE_ENV

from tests.helpers.equivalence import base_args, layout_args
from tests.helpers.elastic import (CONSTANT, LONG, K, _agent, _await, _changes, _coordinator, _kill_ranks, _records,
                                   _register, agent_logs, elastic_args, end_by_notice, final_params_match,
                                   losses_match_one_process, reap, start_host)


def _held(root, origins) -> set[int]:
    """The steps at which snapshot dir `root` holds the committed unit of every node in `origins` (its own, and
    the others' copies its peers pushed: snapshot.py, agent._replicate): what that node alone can resume from."""
    from nanotitan.elastic import snapshot

    held: dict[int, set[int]] = {}
    for u in snapshot.units(root):
        m = snapshot.UNIT.fullmatch(u)
        held.setdefault(int(m.group(1)), set()).add(int(m.group(3)))
    return {step for step, nodes in held.items() if set(origins) <= nodes}


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_join_notice_and_kill(corpus_dir, tmp_path, optimizer):
    from nanotitan.config.config import load_config
    from nanotitan.elastic.rank import snapshot_root

    run = tmp_path / "elastic"
    flags = ("--train.optimizer", optimizer, *CONSTANT)
    # Paced by an emulated network (values unchanged): each rank a node, every collective held ~10 ms.
    args = elastic_args(corpus_dir, run, tmp_path, LONG, "2:3", "relayout") + [
        "--parallel.emulate", "h800", "--parallel.emulate_node_size", "1", "--parallel.emulate_dilation", "0.002",
        *flags]
    root0 = snapshot_root(load_config(None, args), 0)  # node 0's snapshot dir
    logs, files = agent_logs(tmp_path, 3)
    agents: list[subprocess.Popen] = []
    try:
        start_host(args, agents, files, logs)
        agents.append(_agent(args, files[1]))
        # the joiner starts now and imports beside generation 1 (nodes 0 and the other): it joins when the test
        # opens its gate at step 3, not some tens of steps later when a loaded machine has imported it. Which of the
        # two asked for an id first is a race: its id is read from its own log.
        gate = tmp_path / "join_gate"
        agents.append(_agent(args, files[2], {JOIN_GATE_ENV: str(gate)}))
        _await("step 3", lambda: len(_records(run)) >= 3, agents, logs)
        gate.touch()
        _await("the join's re-layout", lambda: len(_changes(run)) >= 1, agents, logs)
        joiner = int(re.search(r"node (\d+) \(joined", logs[2].read_text()).group(1))
        # Each later event waits a few steps past the previous change: the agents' warm ranks are ready again.
        at = _changes(run)[0]["step"] + 8
        _await(f"step {at}", lambda: _records(run)[-1]["step"] >= at, agents, logs)
        agents[1].send_signal(signal.SIGTERM)  # a preemption notice to generation 1's other node
        _await("the notice's re-layout", lambda: len(_changes(run)) >= 2, agents[:1] + agents[2:], logs)
        since = _changes(run)[1]["step"]
        # A snapshot is written on a thread after its step, then each node's unit is copied to the other: wait
        # until node 0 holds both units of one newer than the notice, so that the failure can resume from it
        # whatever the joiner's agent serves (was: each node holding its own unit; a kill right then resumed from
        # the notice's checkpoint, a file of the joiner's unit found on no node that answered: within K, but no
        # snapshot).
        _await(f"a snapshot after step {since} on node 0", lambda: any(s > since for s in _held(root0, (0, joiner))),
               agents[:1] + agents[2:], logs)
        _kill_ranks(agents[2])  # node 2 loses its ranks (and warm ranks); its agent stays
        _await("the failure's re-layout", lambda: len(_changes(run)) >= 3, agents[:1] + agents[2:], logs)
        end = end_by_notice(agents, run, logs, _changes(run)[2]["step"] + 3)
    finally:
        out = reap(agents, files, logs)
    assert [a.returncode for a in agents] == [143, 143, 143], out  # each node's: the job ended on notices

    # Three changes, each to the planner's layout for its world, nothing lost but the kill's.
    changes = _changes(run)
    assert [(c["event"], c["nodes"]) for c in changes] == [("join", [2, 3]), ("notice", [3, 2]), ("failure", [2, 2])], out
    assert [c["new"].split(" M=")[0] for c in changes] == ["dp=1 pp=3 ep=1 tp=1 cp=1", "dp=2 pp=1 ep=1 tp=1 cp=1",
                                                               "dp=2 pp=1 ep=1 tp=1 cp=1"], changes
    assert 3 <= changes[0]["step"] < changes[1]["step"] < changes[2]["step"] < end, changes
    lost = changes[2]["steps_lost"]
    assert [c["steps_lost"] for c in changes[:2]] == [0, 0] and 0 <= lost <= K, changes
    assert changes[2]["step"] % K == 0, changes  # resumed from a snapshot
    assert f"stopped by SIGTERM on node 0 at step {end}" in out, out

    # Every step logged, each loss the single process's; only the lost steps were run twice.
    ref, steps = losses_match_one_process(corpus_dir, tmp_path, run, end, flags)
    assert len(steps) - end <= lost, steps

    # The stop's checkpoint, loaded into one process, holds the single process's parameters.
    final_params_match(corpus_dir, tmp_path, run, ref, end, flags)


# --- bad cases, decided by node 0's coordinator (one process, a real store, no ranks) ---------------------------


def test_world_without_layout_leaves_a_spare_and_a_different_joiner_is_refused(corpus_dir, tmp_path, capsys):
    """5 ranks admit no layout at batch 16 (4 experts, 4 layers): the newest node waits as a spare and the job
    starts on 4; a node with another code or config hash is refused in one line."""
    coord, store, _raw = _coordinator(corpus_dir, tmp_path, "1:8")
    for node in range(5):
        _register(coord, store, node, coord.hash)
    _register(coord, store, 5, "0" * 16)
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
