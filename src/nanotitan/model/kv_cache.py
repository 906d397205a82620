"""The inference-only KV cache: what each attention layer keeps of the tokens it has seen, so that generation runs
every new token through the model once (`Transformer.decode`) instead of re-running the whole context.

Per layer it holds what that attention needs of the past positions: grouped-query attention's keys and values
after their q/k norms and RoPE, (B, Hkv, T, Dh) each, or MLA's per-token latent (B, T, R + Dr), the normed c_kv
and the roped shared key: the R + Dr numbers a token costs DeepSeek-V3's cache (each step up-projects it to the
heads' keys and values). Buffers are allocated once, at model.max_seq_len positions, on a layer's first call; every
layer of one forward writes at the same positions, and `advance` moves them on once the forward is done.

Training never builds one: the training forward takes no cache argument and runs no branch for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class KVCache:
    def __init__(self, max_len: int):
        self.max_len, self.length = max_len, 0  # length: the positions cached so far, [0, length)
        self.layers: dict[str, tuple[torch.Tensor, ...]] = {}

    def positions(self, S: int) -> list[tuple[int, int]]:
        """The global positions of S new tokens as (start, length) runs, what RoPE reads its table at."""
        assert self.length + S <= self.max_len, f"{self.length} cached + {S} new > the cache's {self.max_len}"
        return [(self.length, S)]

    def extend(self, key: str, dim: int, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Layer `key`'s cached tensors with `new` (S positions along `dim`) written after them: each of length + S
        positions, views of the buffers (valid until the next call)."""
        S = new[0].shape[dim]
        buffers = self.layers.get(key)
        if buffers is None:
            buffers = tuple(t.new_empty(t.shape[:dim] + (self.max_len,) + t.shape[dim + 1:]) for t in new)
            self.layers[key] = buffers
        for buf, t in zip(buffers, new):
            buf.narrow(dim, self.length, S).copy_(t)
        return tuple(buf.narrow(dim, 0, self.length + S) for buf in buffers)

    def advance(self, S: int) -> None:
        """The forward that wrote S new positions in every layer is done."""
        self.length += S

    def clear(self) -> None:
        self.length = 0  # the buffers stay: the next prefill overwrites them


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Attention of the S newest positions' queries q (B, H, S, Dk) over every cached position's keys and values
    k (B, Hkv, T, Dk), v (B, Hkv, T, Dv), the S new ones last: query i sees positions [0, T - S + i] (causal, with
    the cache in front). GQA: query head h reads key/value head h // (H / Hkv). -> (B, H, S, Dv)."""
    S, T = q.shape[2], k.shape[2]
    mask = None if S == 1 else torch.ones(S, T, dtype=torch.bool, device=q.device).tril(T - S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
