"""Optimizers beyond torch's AdamW (floor 3, beside state/: it reads the checkpoint's pieces): Muon on the hidden
matrices (muon.py; the split is model/families.py), its Newton-Schulz orthogonalization (newton_schulz.py), its
distributed form over any layout (owners.py), QK-clip (qk_clip.py), its costs for the planner (cost.py) and the
trainer's optimizer (build.py). docs/optim.md."""
