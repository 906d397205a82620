"""Per-tree summary of the rank{R}.json files of NT_PROF_MODE=cpu (scripts/experiments/callprof/sitecustomize.py).

    python scripts/experiments/callprof/cpu.py DIR...
"""
import glob
import json
import statistics
import sys

for d in sys.argv[1:]:
    rows = [json.load(open(f)) for f in sorted(glob.glob(f"{d}/rank*.json"))]
    cpu = [r["cpu_ms"] for r in rows]
    gcs = [r["gc_ms"] for r in rows]
    n = [sum(r["gc_collections"][g] for r in rows) for g in range(3)]
    print(f"{d}: {len(rows)} ranks, main-thread CPU per rank-step mean {statistics.mean(cpu):.2f} ms "
          f"(median {statistics.median(cpu):.2f}); in the garbage collector {statistics.mean(gcs):.3f} ms; "
          f"collections gen0/1/2 over all ranks {n}; objects tracked (mean) {statistics.mean(r['objects'] for r in rows):.0f}")
