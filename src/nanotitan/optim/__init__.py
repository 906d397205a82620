"""Optimizers beyond torch's AdamW: Muon on the hidden matrices (muon.py), its split of the parameters
(families.py), its Newton-Schulz orthogonalization (newton_schulz.py) and its distributed form over any
layout (owners.py). docs/optim.md."""
