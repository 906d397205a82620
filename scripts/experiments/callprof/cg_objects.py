"""Instructions per rank-step by shared object, from the window dumps of NT_PROF_MODE=callgrind (sitecustomize.py).

    python scripts/experiments/callprof/cg_objects.py STEPS DIR...     # each DIR holds callgrind.rank{R}.1 files

Self cost (Ir) summed per object (libpython, libtorch_cpu, libgloo...) and per rank; each DIR one tree. Instruction
counts do not depend on the machine's load, so two trees compare exactly (up to hash-seed and timing effects).
"""
import collections
import glob
import re
import sys


def self_cost(path: str) -> dict:
    names = {"ob": {}, "fn": {}}
    by_ob = collections.Counter()
    ob = "?"
    skip_next = False
    for line in open(path, errors="replace"):
        if line.startswith(("ob=", "fn=", "cob=", "cfn=", "fl=", "fi=", "fe=", "cfi=", "cfl=")):
            key, _, val = line.rstrip("\n").partition("=")
            m = re.match(r"\((\d+)\)(?: (.*))?", val)
            kind = key.lstrip("c") if key in ("cob", "cfn") else key
            if m and kind in names:
                ident, name = m.groups()
                if name is not None:
                    names[kind][ident] = name
                val = names[kind].get(ident, val)
            if key == "ob":
                ob = val
            continue
        if line.startswith("calls="):
            skip_next = True  # the next cost line is the call's inclusive cost, not this function's own
            continue
        if line[:1].isdigit() or line[:1] in "+-*":
            if skip_next:
                skip_next = False
                continue
            parts = line.split()
            if len(parts) >= 2:
                by_ob[ob.rsplit("/", 1)[-1]] += int(parts[1])
    return by_ob


steps = int(sys.argv[1])
for d in sys.argv[2:]:
    for f in sorted(glob.glob(f"{d}/callgrind.rank*.1")):
        c = self_cost(f)
        total = sum(c.values())
        top = ", ".join(f"{k} {v / steps / 1e6:.1f}" for k, v in c.most_common(6))
        print(f"{f}: {total / steps / 1e6:.1f} M instructions per step ({top})")
