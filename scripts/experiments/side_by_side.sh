#!/bin/bash
# Two or more trees' default jobs run AT THE SAME TIME, so that every one of them shares the same cores and the same
# outside load (a shared 2-core machine moves a lone run's step by 10-30% from minute to minute); each job's wall
# time per step between its step-20 and step-(N-10) records is stamped by one poller, and printed as a ratio to
# the first tree's, with the job's CPU per step over the same records (every thread of its ranks and launcher, from
# /proc: less noisy than wall, which a shared machine's other work moves). Used for issue 27 item 8
# (docs/results.md): HEAD beside commit 050fcbc. The CPU is also split: ranks' main threads, their other threads
# (gloo's, the stall record's heartbeat), the launcher.
#
#   git worktree add /tmp/old 050fcbc
#   scripts/experiments/side_by_side.sh TAG 130 old=/tmp/old head=$PWD          # EXTRA="--parallel.dp 2 ..." for a layout
#
# Each tree runs its own src/ (PYTHONPATH) with its own configs/default.toml and data cache (/tmp/cache_NAME).
set -u
tag=$1; n=$2; shift 2
py=${PYTHON:-$(cd "$(dirname "$0")/../.." && pwd)/.venv/bin/python}  # absolute: each job runs from /tmp
names=()
for spec in "$@"; do
  name=${spec%%=*}; root=${spec#*=}; names+=("$name")
  dir=/tmp/sbs_${name}_$tag; rm -rf "$dir"
  (cd /tmp && PYTHONPATH=$root/src NANOTITAN_CACHE=/tmp/cache_$name timeout 1200 "$py" -c \
     "import sys; from nanotitan.cli import main; sys.argv[0] = 'nanotitan'; sys.exit(main())" \
     train --config "$root/configs/default.toml" --train.steps "$n" --train.eval_every 0 --run.dir "$dir" \
     --run.progress false --run.tensorboard false --train.ckpt_at_end false --train.sample_tokens 0 ${EXTRA:-} \
     > "$dir.log" 2>&1) &
done
"$py" - "$tag" "$n" "${names[@]}" <<'PY'
import json, os, sys, time
tag, n, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
lo, hi = 20, n - 10
stamps = {v: {} for v in names}
cpu = {v: {} for v in names}
tick = os.sysconf("SC_CLK_TCK")


def job_cpu(v: str) -> tuple[float, float, float]:
    """CPU seconds (user + system) of the job's processes so far: (all, the ranks' main threads, the ranks' other
    threads: gloo's, the stall record's heartbeat); the rest is the launcher (torchrun's agent)."""
    mark, total, main, other = f"/tmp/sbs_{v}_{tag}\0".encode(), 0, 0, 0  # the --run.dir argument, whole
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            if mark not in cmd:
                continue
            rank = b"-m\0nanotitan.cli\0" in cmd  # a rank; the launcher runs `python -c ...`
            for tid in os.listdir(f"/proc/{pid}/task"):
                fields = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
                t = int(fields[11]) + int(fields[12])  # utime, stime
                total += t
                if rank:
                    main, other = (main + t, other) if tid == pid else (main, other + t)
        except OSError:
            pass
    return total / tick, main / tick, other / tick


deadline = time.time() + 1200
while time.time() < deadline and not all(hi in s for s in stamps.values()):
    for v in names:
        try:
            with open(f"/tmp/sbs_{v}_{tag}/metrics.jsonl") as f:
                for line in f:
                    if line.startswith('{"step"') and line.endswith("\n"):
                        step = json.loads(line)["step"]
                        if step not in stamps[v]:
                            stamps[v][step] = time.time()
                            if step in (lo, hi):
                                cpu[v][step] = job_cpu(v)
        except OSError:
            pass
    time.sleep(0.02)
missing = [v for v in names if hi not in stamps[v] or lo not in stamps[v]]
if missing:
    sys.exit(f"{tag}: no step-{lo}/{hi} records from {', '.join(missing)} (see /tmp/sbs_NAME_{tag}.log)")
w = {v: (s[hi] - s[lo]) / (hi - lo) for v, s in stamps.items()}
c, cm, co = ({v: (s[hi][k] - s[lo][k]) / (hi - lo) for v, s in cpu.items()} for k in range(3))
print(tag, f"steps {lo}-{hi}:", "  ".join(f"{v} {w[v] * 1e3:.1f} ms ({w[v] / w[names[0]]:.3f}x)" for v in names),
      "| job CPU per step:", "  ".join(f"{v} {c[v] * 1e3:.0f} ms ({c[v] / c[names[0]]:.3f}x)" for v in names),
      "| ranks' main threads:", "  ".join(f"{v} {cm[v] * 1e3:.0f} ({cm[v] / cm[names[0]]:.3f}x)" for v in names),
      "| other threads:", "  ".join(f"{v} {co[v] * 1e3:.0f}" for v in names),
      "| launcher:", "  ".join(f"{v} {(c[v] - cm[v] - co[v]) * 1e3:.1f}" for v in names))
PY
wait
