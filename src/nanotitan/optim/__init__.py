"""The trainer's optimizers (floor 3, beside state/: it reads the checkpoint's pieces; docs/optim.md).

    adamw.py          AdamW, Adam's state layout, the weight-decay rule, and what every optimizer declares (its
                      kind, each group's lr ratio, its state, what a layout change does)
    muon.py           Muon on the hidden matrices (the family tags it takes; the split is model/families.py)
    newton_schulz.py  its Newton-Schulz orthogonalization
    owners.py         its distributed form over any layout: each matrix whole on one owner
    geometry.py       every stage rank's pieces of every Muon matrix (parallel/where.py's answer), nothing exchanged
    qk_clip.py        QK-clip
    cost.py           Muon's costs for the planner
    build.py          the trainer's optimizer over a ModelShard
"""
