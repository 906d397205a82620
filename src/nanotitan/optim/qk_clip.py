"""train.qk_clip TAU (MuonClip, Kimi K2, arXiv:2507.20534 §2.1): after each update, every attention head whose largest
logit in the step exceeded TAU has its query and key weights scaled so that logit would have been TAU.

    gamma_h = TAU / max_h  (heads over TAU only)
    MHA        W_q, W_k rows of head h (and biases)  x sqrt(gamma_h)
    GQA        W_q rows of head h x gamma_h (the key head is shared by a group: left alone, as MLA's shared rope key)
    MLA        q's nope rows x sqrt(gamma_h), q's rope rows x gamma_h (q_b_proj, or q_proj without a q latent),
               kv_b_proj's k_nope rows x sqrt(gamma_h); the rope key, shared by every head, untouched (Kimi K2)

max_h is the whole step's: every microbatch's training forward (model/qk_max.py), then a MAX over the world of a
[layers, heads] table (`QKClip.table`: a row per global layer, filled by the stage that holds it, each TP rank its own
heads; parallel/step.py's StepEnd packs it in the step's one MAX), so every layout scales the same heads by the same
factors. The scaling (`QKClip.rescale`) acts on the live weights through the checkpoint's pieces (state/keys.py:
whole rows at zero 0/1/2 once the gathers landed, FSDP2's rows, TP's head slices), an elementwise product the single
process does identically. `qk_max` (the table's max: every layer, every stage) goes into the step's record. Refused
with model.qk_norm (a normalised q or k ignores its weights' scale).
"""

from __future__ import annotations

import torch

from ..model.mla import MLA
from ..state.keys import keyed_state


def _attentions(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(global prefix "layers.L.attn", module) of every attention module of the shard, in name order."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    out = []
    for mod in model.modules():
        if getattr(mod, "qk_track", False):
            anchor = mod.q_proj if hasattr(mod, "q_proj") else mod.q_b_proj
            out.append((name_of[id(anchor.weight)].rsplit(".", 2)[0], mod))
    return sorted(out, key=lambda x: x[0])


def _row_scales(mod, gamma: torch.Tensor) -> dict[str, torch.Tensor]:
    """{param suffix: per-row factor over the whole (all heads) weight} for one attention module."""
    root = gamma.sqrt()
    if isinstance(mod, MLA):
        q = torch.cat([root[:, None].expand(-1, mod.nope), gamma[:, None].expand(-1, mod.rope)], 1).reshape(-1)
        kv = torch.cat([root[:, None].expand(-1, mod.nope), torch.ones(len(gamma), mod.v_dim)], 1).reshape(-1)
        qname = "q_b_proj" if hasattr(mod, "q_b_proj") else "q_proj"
        return {f"{qname}.weight": q, "kv_b_proj.weight": kv}
    Dh, mha = mod.head_dim, mod.n_kv_heads == mod.n_heads
    q = (root if mha else gamma).repeat_interleave(Dh)
    out = {"q_proj.weight": q, "q_proj.bias": q}
    if mha:
        out.update({"k_proj.weight": q, "k_proj.bias": q})
    return out


class QKClip:
    """QK-clip over a shard (train.qk_clip = `tau`; 0: off, no table). Every step: `table` (this rank's), the step's
    MAX of it over the world (parallel/step.py), `rescale`."""

    def __init__(self, shard, tau: float):
        self.shard, self.tau = shard, tau

    def table(self) -> torch.Tensor | None:
        """[layers, heads] of the step's max logits this rank saw, per global layer (its heads' columns: TP slices
        them contiguously), -inf elsewhere; each attention module's record then cleared. None when off."""
        if not self.tau:
            return None
        model, dims = self.shard.model, self.shard.dims
        attns, rows = _attentions(model), model.cfg.n_layers + model.cfg.mtp_layers  # MTP blocks: rows n_layers..
        H = max((m.n_heads for _, m in attns), default=1)
        table = torch.full((rows, H), float("-inf"), device=next(model.parameters()).device)
        for prefix, m in attns:
            if m.qk_max is not None:
                h = m.qk_max.shape[0]  # this rank's heads
                table[_layer(prefix), dims.tp_rank * h:(dims.tp_rank + 1) * h] = m.qk_max
            m.qk_max = None
        return table

    @torch.no_grad()
    def rescale(self, table: torch.Tensor, apply: bool = True) -> None:
        """`table` maximised over the world: the heads over tau get their q/k weights scaled back (`apply`: not on a
        skipped step)."""
        attns, tau = _attentions(self.shard.model), self.tau
        over = table > tau
        if not (apply and attns and bool(over.any())):
            return
        gammas = torch.where(over, tau / table, torch.ones_like(table))
        scales = {f"model.{prefix}.{k}": v for prefix, m in attns
                  for k, v in _row_scales(m, gammas[_layer(prefix), :m.n_heads].cpu()).items()}
        for key, chunks in keyed_state(self.shard.model, None, self.shard).items():
            if key in scales:
                for off, t in chunks.boxes.items():
                    r = scales[key][off[0]:off[0] + t.shape[0]].to(t.device, t.dtype)
                    t.mul_(r.view(-1, *[1] * (t.dim() - 1)))


def _layer(prefix: str) -> int:
    """The global layer of an attention module's prefix "layers.L.attn"."""
    return int(prefix.split(".")[1])
