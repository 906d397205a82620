"""A chaos run of 3 minutes (tests/helpers/chaos.py; scripts/chaos.py runs 20, docs/reliability.md): a 3-node
one-host elastic job under random faults (SIGTERM, kill -9, an agent paused 2-8 s, a full disk during a save, joins,
some over a slow link; collectives paced by the network emulator). Every fault costs at most K steps (planned
changes none), every node's exit code is the truthful one, and nothing is left behind: no process of the job,
no snapshot dir in RAM, no temp dir (those of agents killed -9 included: the agents on the host sweep them)."""

import pytest

from tests.helpers.chaos import Chaos, table


@pytest.mark.slow
@pytest.mark.timeout(900)  # several agents' jobs on the shared cores: 3-5 min under load
def test_three_minutes_of_chaos(tmp_path):
    r = Chaos(tmp_path / "chaos", minutes=3, seed=1).go()
    report = table(r)
    assert len(r["faults"]) >= 3, report
    assert all(f["within_k"] for f in r["faults"]), report
    assert all(e["truthful"] for e in r["exits"]), report
    assert r["processes_left"] == [] and r["snapshot_dirs_left"] == [] and r["temp_dirs_left"] == {}, report
