"""Planner vs reality: predicted step time and peak memory per rank of every layout that
`nanotitan bench layouts` measured, with the errors and Spearman's rho of the ranking.

    nanotitan plan --measure --out docs/experiments/cpu_profile.json     # this machine's profile
    nanotitan bench layouts --gpus 2 4                                   # docs/experiments/layouts.json
    python benchmarks/calibrate_planner.py                               # -> docs/calibration.md
"""

import argparse
import json
import sys
from pathlib import Path

from nanotitan.config import load_config
from nanotitan.plan import calibrate, format_calibration


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="docs/experiments/layouts.json")
    ap.add_argument("--profile", default="docs/experiments/cpu_profile.json")
    ap.add_argument("--config", default="configs/bench.toml")
    ap.add_argument("--out", default="docs/calibration.md")
    args = ap.parse_args()
    data = json.loads(Path(args.layouts).read_text())
    cfg = load_config(args.config)
    rows = [dict(r, peak_mem_bytes=r["peak_mem_per_rank"]) for r in data["rows"]]
    sections = []
    for world in sorted({r["world"] for r in rows}):
        res = calibrate([r for r in rows if r["world"] == world], cfg, args.profile)
        sections.append(f"## N = {world}\n\n{format_calibration(res)}\n")
    res_all = calibrate(rows, cfg, args.profile)
    text = ("# Planner calibration against measured layouts\n\n"
            f"Profile `{args.profile}` (from `nanotitan plan --measure`), measurements `{args.layouts}` "
            f"(from `nanotitan bench layouts`), config `{args.config}`; produced by "
            "`python benchmarks/calibrate_planner.py`. Memory: predicted tensor bytes plus the profile's fixed "
            "process reserve, against measured peak RSS per rank.\n\n"
            + "\n".join(sections) + f"\n## All layouts\n\n{format_calibration(res_all)}\n")
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
