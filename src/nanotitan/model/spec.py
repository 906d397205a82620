"""ModelShardSpec: which embeddings, layers and experts a rank owns.

The same model code builds the full model (`ModelShardSpec.full(cfg)`) and any pipeline-stage /
expert shard; parameters keep their global names (layer keys are global layer indices) so a
shard's state is a slice of the full model's.

Stage boundaries may fall inside a block, between its attention and its FFN/MoE half: layer counts are then
multiples of 0.5 (`parallel.pp_layers 2.5,1.5`; `auto` picks them when they balance better). Attention is
about a fifth of an MoE block's time, so half-layer cuts let two stages carry a head worth half a layer
evenly (docs/pp.md). A split block keeps its global name on both sides: `layers.2.attn.*` on one stage,
`layers.2.moe.*` on the next.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config.config import Config, ModelConfig
from ..config.layout import expert_ranks
from ..config.parse import tidy_counts


@dataclass(frozen=True)
class ModelShardSpec:
    has_token_embed: bool
    has_pos_embed: bool
    layer_start: int  # first global layer index owned (inclusive)
    layer_end: int  # one past the last global layer owned
    expert_start: int  # first global expert id owned in every MoE layer
    expert_end: int
    has_head: bool  # final norm + LM head + loss
    first_ffn_only: bool = False  # block layer_start runs its FFN half only (its attention is on the chunk before)
    last_attn_only: bool = False  # block layer_end-1 runs its attention half only (its FFN is on the chunk after)
    mtp_layers: int = 0  # multi-token prediction modules (model/mtp.py): on the shard with the head, 0 elsewhere

    @property
    def embed_replica(self) -> bool:
        """The token embedding held only for the MTP on a last stage that is not the first: a replica of stage 0's,
        its gradient summed with stage 0's every step (parallel/tied.py), as Megatron ties embeddings under PP."""
        return self.mtp_layers > 0 and not self.has_token_embed

    @property
    def layers(self) -> range:
        """Global indices of the blocks this shard runs, wholly or one half."""
        return range(self.layer_start, self.layer_end)

    def block_parts(self, i: int) -> tuple[bool, bool]:
        """(attention, FFN) halves of block i that this shard owns."""
        return (not (self.first_ffn_only and i == self.layer_start),
                not (self.last_attn_only and i == self.layer_end - 1))

    @staticmethod
    def full(cfg: ModelConfig) -> "ModelShardSpec":
        return ModelShardSpec(True, cfg.pos_emb == "learned", 0, cfg.n_layers, 0, cfg.num_experts, True,
                              mtp_layers=cfg.mtp_layers)


def layer_bounds(n_layers: int, pp: int, pp_rank: int, pp_layers: list[float] | None = None) -> tuple[float, float]:
    """Consecutive layer range [start, end) of stage `pp_rank`: an explicit split, or as even as possible
    (earlier stages take the remainder; the last stage also carries the head, so it is lighter in layers).
    A bound x.5 cuts block x between its attention and its FFN."""
    counts = list(pp_layers) if pp_layers else even_counts(n_layers, pp)
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]


def block_halves(start: float, end: float) -> list[tuple[int, bool, bool]]:
    """(block index, owns attention, owns FFN) of every block touched by the layer range [start, end)."""
    lo, hi = 2 * start, 2 * end  # in half-blocks: 2i is block i's attention, 2i+1 its FFN
    return [(i, lo <= 2 * i < hi, lo <= 2 * i + 1 < hi) for i in range(int(start), math.ceil(end))]


def even_counts(n_layers: int, chunks: int) -> list[int]:
    base, rem = divmod(n_layers, chunks)
    return [base + (1 if c < rem else 0) for c in range(chunks)]


def chunk_layer_counts(cfg: Config) -> list[float]:
    """Layers of each of the PP*V model chunks, in pipeline order (multiples of 0.5: module docstring):
    parallel.pp_layers, or as even as possible (whole layers). Counts only: the config is resolved
    (resolve.py), so `auto` is already the planner's numbers and virtual_stages the chunks a rank runs."""
    p = cfg.parallel
    assert p.pp_layers != "auto", "parallel.pp_layers=auto is the planner's to balance: resolve the config (resolve.py)"
    return tidy_counts(p.pp_layers) if p.pp_layers else even_counts(cfg.model.n_layers, p.pp * p.virtual_stages)


def build_chunk_specs(cfg: Config, pp_rank: int = 0, ep_rank: int = 0) -> list[ModelShardSpec]:
    """The specs of this rank's V model chunks (Megatron's virtual pipeline stages): chunk v is global chunk
    v*PP + pp_rank, so each rank holds every PP-th slice of the layers; global chunk 0 owns the embeddings,
    global chunk PP*V-1 the head and the MTP modules. With V = 1 the one spec is the rank's pipeline stage. ep_rank
    is the rank's place among the EP*CP*TP shards of the experts (ParallelDims.moe_ep_rank: EP folded over CP and TP,
    docs/tp.md, docs/cp.md)."""
    p, m = cfg.parallel, cfg.model
    counts = chunk_layer_counts(cfg)
    n_chunks, e_local = len(counts), m.num_experts // expert_ranks(p.ep, p.cp, p.tp)
    specs = []
    for c in range(pp_rank, n_chunks, p.pp):
        start = sum(counts[:c])
        blocks = block_halves(start, start + counts[c])  # (block, owns attention, owns FFN), as the planner counts
        specs.append(ModelShardSpec(
            has_token_embed=c == 0,
            has_pos_embed=c == 0 and m.pos_emb == "learned",
            layer_start=blocks[0][0],
            layer_end=blocks[-1][0] + 1,
            expert_start=ep_rank * e_local,
            expert_end=(ep_rank + 1) * e_local,
            has_head=c == n_chunks - 1,
            first_ffn_only=not blocks[0][1],
            last_attn_only=not blocks[-1][2],
            mtp_layers=m.mtp_layers if c == n_chunks - 1 else 0,
        ))
    return specs

