"""train.optimizer=adamw, Adam's state layout, and what every optimizer of the trainer declares (Muon too, muon.py).

No caller asks an optimizer's type; the trainer and the floors below it ask the optimizer:

    kind                 "adamw" or "muon": the kind of state its checkpoints hold (state/checkpoint.py refuses another)
    group["lr_ratio"]    each group's learning rate over train.lr's schedule (train.py applies it every step)
    state_of(p, group)   p's state, created first exactly as the optimizer's lazy init would: an optimizer that has not
                         stepped can be saved, loaded, moved and metered (parallel/dp/'s `sharded_state` calls it)
    ensure_state()       every param's state (the checkpoint path: torch's own state-dict init skips an optimizer
                         whose params have a .grad)
    prepare()            what its first step makes, made now (the dry run meters a step as a job's later steps run)
    on_layout_change()   the experts moved between slots (parallel/rebalance.py): drop what knew the old layout

Its param groups are the gradient sync's, one per family tag (model/families.py: {"params", "tag"});
`decay_groups` gives each its weight decay: on matrices only, the trainer's rule.
"""

from __future__ import annotations

import torch

from ..model.families import VECTOR


def adam_state(optimizer: torch.optim.Optimizer, p: torch.Tensor, group: dict) -> dict:
    """`optimizer.state[p]`, created first if empty exactly as Adam(W)'s lazy init would (zero moments, step 0;
    `step` a float32 tensor on the param's device when fused/capturable, else a CPU scalar of the default float
    dtype; max_exp_avg_sq with amsgrad). The one place that knows Adam's state layout; `group` is p's group."""
    state = optimizer.state[p]
    if state:
        return state
    on_device = group.get("fused") or group.get("capturable")
    fp64 = torch.get_default_dtype() == torch.float64 and not group.get("fused")  # torch's _get_scalar_dtype
    step_dtype = torch.float64 if fp64 else torch.float32
    state["step"] = torch.zeros((), dtype=step_dtype, device=p.device if on_device else "cpu")
    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def decay_groups(tagged: list[dict], weight_decay: float) -> list[dict]:
    """The sync's tagged groups with their weight decay: matrices decay, vectors (norms, biases) do not."""
    return [{**g, "weight_decay": 0.0 if g["tag"] == VECTOR else weight_decay} for g in tagged]


class Declared:
    """The declarations of the module docstring, with AdamW's answers (mixed in before a torch Optimizer)."""
    kind = "adamw"

    def group_of(self, p: torch.Tensor) -> dict:
        return next(g for g in self.param_groups if any(q is p for q in g["params"]))

    def state_of(self, p: torch.Tensor, group: dict | None = None) -> dict:
        return adam_state(self, p, group or self.group_of(p))

    def ensure_state(self) -> None:
        for g in self.param_groups:
            for q in g["params"]:
                self.state_of(q, g)

    def prepare(self) -> None:
        self.ensure_state()

    def on_layout_change(self) -> None:
        """Nothing: each element's moments move with it, and no plan knows where it lives."""


class AdamW(Declared, torch.optim.AdamW):
    """torch's AdamW (fused on the trainer's path, ~3x faster than the default on CPU: the baselines), every group on
    train.lr's schedule (lr_ratio 1)."""

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **kwargs)
        self.defaults["lr_ratio"] = 1.0  # a group added later gets it too
        for g in self.param_groups:
            g.setdefault("lr_ratio", 1.0)
