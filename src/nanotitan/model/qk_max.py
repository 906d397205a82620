"""QK-clip's observation (train.qk_clip; optim/qk_clip.py acts on it): each head's largest causal attention logit
over a step's training forwards, kept on the attention module (`qk_max`, (H_local,) fp32). Off unless the module is
marked (`qk_track`); eval forwards (no grad) are not counted. It materialises the (B, H, S, S) logits once more
beside SDPA: a cost paid only with qk_clip on."""

from __future__ import annotations

import torch


def track(model: torch.nn.Module, kinds: tuple[type, ...]) -> None:
    """Mark every attention module of `kinds` (Attention, MLA) to observe its heads' max logit."""
    for mod in model.modules():
        if isinstance(mod, kinds):
            mod.qk_track, mod.qk_max = True, None


def observe(module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, scale: float) -> None:
    """module.qk_max <- max(module.qk_max, per-head max of scale * q k^T under the causal mask); q (B, H, S, D),
    k (B, H or Hkv, S, D) (GQA: query head h reads key head h // (H / Hkv))."""
    if getattr(module, "qk_track", False) and torch.is_grad_enabled():  # a training forward (or its recompute)
        with torch.no_grad():
            _observe(module, q.detach(), k.detach(), scale)


def _observe(module, q, k, scale) -> None:
    H, Hkv, S = q.shape[1], k.shape[1], q.shape[2]
    k = k.float().repeat_interleave(H // Hkv, dim=1) if Hkv != H else k.float()
    logits = (q.float() @ k.mT) * scale  # (B, H, S, S)
    logits.masked_fill_(torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    m = logits.amax(dim=(0, 2, 3))  # (H,)
    prev = getattr(module, "qk_max", None)
    module.qk_max = m if prev is None else torch.maximum(prev, m)
