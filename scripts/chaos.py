"""The chaos run (docs/reliability.md, "A chaos run"): a 3-node one-host elastic job under random faults (SIGTERM,
kill -9, an agent paused 2-8 s, a full disk during a save, joins, some over a slow link; every collective paced by
the network emulator) for MINUTES, then node 0's notice ends it. Prints and writes OUT/chaos.md (the table: each
fault with the change it caused and its steps lost against K, each agent's exit code against the truthful one,
what was left behind) and OUT/chaos.json. Run from the repository root, on a quiet machine:

    PYTHONPATH=src:. python scripts/chaos.py --minutes 20 --out /tmp/chaos20 [--seed 0] [--k 5]

tests/elastic/test_chaos.py runs 3 minutes of it in the slow tier (tests/helpers/chaos.py: the driver).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.helpers, from the repository root

from tests.helpers.chaos import Chaos, table  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--k", type=int, default=5)
    a = ap.parse_args()
    r = Chaos(a.out, a.minutes, a.seed, a.k).go()
    print(table(r))
    ok = all(f["within_k"] for f in r["faults"]) and all(e["truthful"] for e in r["exits"]) \
        and not (r["processes_left"] or r["snapshot_dirs_left"] or r["temp_dirs_left"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
