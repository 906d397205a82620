"""What Muon costs a layout, for the planner and `scripts/experiments/muon.py plan` (docs/optim.md "Costs"):

    ns_flops        Newton-Schulz FLOPs per step of every Muon matrix (one per routed expert), and the busiest
                    rank's share once owners are balanced (owners.py: greedy by FLOPs over the ranks sharing them)
    traffic_bytes   per rank per step: the pieces of matrices it does not own, to their owners and back (2 x 4 bytes
                    x (N - 1) / N of the sliced matrices' elements, N the ranks a matrix is cut over: TP x the ZeRO
                    data ranks at zero >= 1); 0 at zero 0 without TP, and for experts under EP at zero 0
    state_bytes     optimizer state: Muon one fp32 buffer per element, AdamW two (+ its step)

Counted from the model's parameter shapes (built on the meta device), so it costs no memory.
"""

from __future__ import annotations

import torch

from ..config.config import Config
from ..model.spec import ModelShardSpec
from ..model.transformer import Transformer, is_expert_param
from ..model.families import is_muon_matrix
from .newton_schulz import ns_flops


_COUNTS: dict[tuple, tuple] = {}


def _model_counts(cfg: Config, steps: int) -> tuple:
    """(Muon matrices, dense and expert NS FLOPs per step, the largest matrix's, dense / expert Muon elements,
    AdamW elements) of `cfg`'s model."""
    with torch.device("meta"):
        model = Transformer(cfg.model, ModelShardSpec.full(cfg.model), cfg.train.seed)
    matrices, expert_elems, dense_elems, adam_elems = [], 0, 0, 0
    for name, q in model.named_parameters():
        if not is_muon_matrix(name, q):
            adam_elems += q.numel()
            continue
        if q.dim() == 3:  # one matrix per routed expert
            matrices += [(name, tuple(q.shape[1:]))] * q.shape[0]
            expert_elems += q.numel()
        else:
            matrices.append((name, tuple(q.shape)))
            dense_elems += q.numel()
    flops = {name: 0 for name, _ in matrices}
    for name, (m, n) in matrices:
        flops[name] += ns_flops(m, n, steps)
    dense_f = sum(f for n, f in flops.items() if not is_expert_param(n))
    largest = max((ns_flops(m, n, steps) for _, (m, n) in matrices), default=0)
    return len(matrices), dense_f, sum(flops.values()) - dense_f, largest, dense_elems, expert_elems, adam_elems


def muon_costs(cfg: Config, steps: int | None = None) -> dict:
    """Muon's per-step costs for `cfg`'s model and layout (dp, tp, ep, pp, zero); figures per rank are for the
    busiest rank of a stage, with the model's layers split evenly over pp."""
    steps = steps or cfg.train.muon_ns_steps
    p = cfg.parallel
    key = (repr(cfg.model), steps)
    if key not in _COUNTS:  # the planner asks once per layout; the model's counts are the same for all of them
        _COUNTS[key] = _model_counts(cfg, steps)
    n_matrices, dense_f, expert_f, largest, dense_elems, expert_elems, adam_elems = _COUNTS[key]
    # a dense matrix is cut over TP x (at zero >= 1) the stage's data ranks, who share its work as owners; whole
    # elsewhere, each replica orthogonalizes it. An expert is cut over its expert-DP ranks at zero >= 1 only.
    cut = (p.dp * p.ep if p.zero >= 1 else 1) * p.tp
    expert_cut = p.dp if p.zero >= 1 else 1
    moved_dense = 2 * 4 * dense_elems * (cut - 1) / cut / cut
    moved_expert = 2 * 4 * expert_elems / p.ep * (expert_cut - 1) / expert_cut / expert_cut
    moved = moved_dense + moved_expert
    return {"matrices": n_matrices, "ns_flops_step": dense_f + expert_f,
            "ns_flops_rank": (dense_f / cut + expert_f / p.ep / expert_cut) / p.pp,
            "largest_matrix_flops": largest,
            "traffic_bytes_rank": moved / p.pp,
            # the same split by group (the planner's links): dense matrices over TP x the non-expert DP ranks,
            # experts over the expert-DP ranks
            "traffic_bytes_rank_dense": moved_dense / p.pp, "traffic_bytes_rank_expert": moved_expert / p.pp,
            "dense_elems": dense_elems, "expert_elems": expert_elems, "adam_elems": adam_elems,
            "muon_state_bytes": 4 * (dense_elems + expert_elems), "adamw_state_bytes_same_params":
            8 * (dense_elems + expert_elems), "adamw_rest_state_bytes": 8 * adam_elems}
