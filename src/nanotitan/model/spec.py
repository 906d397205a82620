"""ModelShardSpec: which embeddings, layers and experts a rank owns.

The same model code builds the full model (`ModelShardSpec.full(cfg)`) and any pipeline-stage /
expert shard; parameters keep their global names (layer keys are global layer indices) so a
shard's state is a slice of the full model's.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Config, ModelConfig


@dataclass(frozen=True)
class ModelShardSpec:
    has_token_embed: bool
    has_pos_embed: bool
    layer_start: int  # first global layer index owned (inclusive)
    layer_end: int  # one past the last global layer owned
    expert_start: int  # first global expert id owned in every MoE layer
    expert_end: int
    has_head: bool  # final norm + LM head + loss

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_end)

    @staticmethod
    def full(cfg: ModelConfig) -> "ModelShardSpec":
        return ModelShardSpec(True, cfg.pos_emb == "learned", 0, cfg.n_layers, 0, cfg.num_experts, True)


def layer_bounds(n_layers: int, pp: int, pp_rank: int, pp_layers: list[int] | None = None) -> tuple[int, int]:
    """Consecutive layer range of stage `pp_rank`: an explicit split, or as even as possible
    (earlier stages take the remainder; the last stage also carries the head, so it is lighter in layers)."""
    if pp_layers:
        counts = list(pp_layers)
    else:
        base, rem = divmod(n_layers, pp)
        counts = [base + (1 if s < rem else 0) for s in range(pp)]
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]


def build_shard_spec(cfg: Config, pp_rank: int = 0, ep_rank: int = 0) -> ModelShardSpec:
    p, m = cfg.parallel, cfg.model
    first, last = pp_rank == 0, pp_rank == p.pp - 1
    layer_start, layer_end = layer_bounds(m.n_layers, p.pp, pp_rank, p.pp_layers)
    e_local = m.num_experts // p.ep
    return ModelShardSpec(
        has_token_embed=first,
        has_pos_embed=first and m.pos_emb == "learned",
        layer_start=layer_start,
        layer_end=layer_end,
        expert_start=ep_rank * e_local,
        expert_end=(ep_rank + 1) * e_local,
        has_head=last,
    )
