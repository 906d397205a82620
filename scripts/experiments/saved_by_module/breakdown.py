"""Per rank and step: the saved-activation peak split into routed experts and the rest (sitecustomize.py's
JSON).  python breakdown.py CPPROBE_DIR N_RANKS"""
import json, re, sys
d = sys.argv[1]; n = int(sys.argv[2])
for r in range(n):
    m = json.load(open(f"{d}/rank{r}.json"))[0]
    for i, ap in enumerate(m["steps"]):
        if not ap: continue
        agg = {}
        for t, b in ap["by_tag"].items():
            k = "experts" if "moe.experts" in t else "other"
            agg[k] = agg.get(k, 0) + b
        print(f"rank {r} step {i+1}: peak {ap['bytes']/2**20:7.1f}  experts {agg.get('experts',0)/2**20:7.1f}  other {agg.get('other',0)/2**20:7.1f}")
