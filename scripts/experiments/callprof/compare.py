"""Python calls per rank-step, two trees side by side, from the dirs scripts/experiments/callprof/sitecustomize.py wrote.

    python scripts/experiments/callprof/compare.py OLD_DIR NEW_DIR [STEPS=20] [TOP=40]

Prints the total calls and profiled thread-CPU per rank-step of each, then the functions whose calls per rank-step
differ most (keyed by file path below site-packages/ or src/, and name: line numbers move between trees).
"""
import glob
import pstats
import re
import sys


def load(d: str) -> tuple[dict, int]:
    files = sorted(glob.glob(f"{d}/rank*.prof"))
    per = {}
    for f in files:
        for (path, line, name), (cc, nc, tt, ct, _) in pstats.Stats(f).stats.items():
            path = re.sub(r".*/(site-packages|src)/", "", path)
            key = f"{path}:{name}"
            c, t = per.get(key, (0, 0.0))
            per[key] = (c + nc, t + tt)
    return per, len(files)


old, n_old = load(sys.argv[1])
new, n_new = load(sys.argv[2])
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 20
top = int(sys.argv[4]) if len(sys.argv) > 4 else 40
ro, rn = n_old * steps, n_new * steps
tot = lambda d, r: (sum(c for c, _ in d.values()) / r, sum(t for _, t in d.values()) / r * 1e3)  # noqa: E731
(co, to), (cn, tn) = tot(old, ro), tot(new, rn)
print(f"ranks {n_old} / {n_new}, {steps} steps: calls per rank-step {co:.0f} -> {cn:.0f} ({cn - co:+.0f}); "
      f"profiled thread CPU per rank-step {to:.1f} -> {tn:.1f} ms ({tn - to:+.1f})")
rows = []
for k in set(old) | set(new):
    a, b = old.get(k, (0, 0.0)), new.get(k, (0, 0.0))
    rows.append((b[0] / rn - a[0] / ro, a[0] / ro, b[0] / rn, (b[1] / rn - a[1] / ro) * 1e6, k))
rows.sort(key=lambda r: -abs(r[0]))
print(f"{'d calls':>8} {'old':>7} {'new':>7} {'d us':>8}  function")
for d, a, b, dt, k in rows[:top]:
    print(f"{d:+8.1f} {a:7.1f} {b:7.1f} {dt:+8.0f}  {k}")
