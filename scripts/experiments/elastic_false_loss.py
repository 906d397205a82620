"""No false losses (issue 49, item 8): two elastic jobs at once on the same cores, each two loopback "nodes" of one
rank (the test model, a snapshot every K = 5 steps), 2,000 steps each. Node 0 judges each node by its liveness
connection (a beat every 0.25 s, a loss after 4 s of silence: elastic/liveness.py); on a loaded machine a
scheduling or GIL pause must not read as a loss. Passes when both jobs finish with exit 0, one generation each
(no change in elastic.jsonl, no `lost` line), every step logged; prints each job's wall time, its node 0's
longest silence of a node, and the load average.

    PYTHONPATH=src:. python scripts/experiments/elastic_false_loss.py [--steps 2000] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.helpers, from the repository root

from tests.conftest import make_corpus  # noqa: E402
from tests.helpers.elastic import _agent, _changes, _records, elastic_args  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="elastic-false-loss-") as d:
        d = Path(d)
        corpus = make_corpus(d / "corpus")
        os.environ.setdefault("NANOTITAN_CACHE", str(d / "cache"))
        jobs = []
        t0 = time.monotonic()
        for j in range(a.jobs):
            run = d / f"job{j}" / "run"
            (d / f"job{j}").mkdir()
            args = elastic_args(corpus, run, d / f"job{j}", a.steps, "2", f"falseloss{j}") + [
                "--run.log_every", "10", "--parallel.timeout_s", "600"]
            logs = [d / f"job{j}" / f"agent{i}.log" for i in range(2)]
            files = [open(p, "w") for p in logs]
            agents = [_agent(args, f) for f in files]  # the first to bind the endpoint is node 0
            jobs.append((run, logs, files, agents))
        loads = []
        while any(ag.poll() is None for _, _, _, agents in jobs for ag in agents):
            loads.append(os.getloadavg()[0])
            time.sleep(5)
            if time.monotonic() - t0 > 3 * 3600:
                print("timed out")
                return 1
        wall = time.monotonic() - t0
        ok = True
        for j, (run, logs, files, agents) in enumerate(jobs):
            for f in files:
                f.close()
            out = "\n".join(p.read_text() for p in logs)
            steps = sorted({r["step"] for r in _records(run)})
            lost = [l for l in out.splitlines() if " lost" in l or "failed on node" in l]
            silence = [l for l in out.splitlines() if "longest silence" in l]
            good = [ag.returncode for ag in agents] == [0, 0] and not _changes(run) and not lost and \
                steps and steps[-1] == a.steps
            ok &= bool(good)
            print(json.dumps({"job": j, "ok": bool(good), "codes": [ag.returncode for ag in agents],
                              "last_step": steps[-1] if steps else None, "changes": len(_changes(run)),
                              "lost_lines": lost[:3], "silence": silence[:1]}))
            if not good:
                print(out[-4000:])
        print(json.dumps({"wall_s": round(wall), "load_avg_min_median_max": [
            round(min(loads), 1), round(sorted(loads)[len(loads) // 2], 1), round(max(loads), 1)] if loads else []}))
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
