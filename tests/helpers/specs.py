"""Test helper: the spec of one rank's pipeline stage, for tests that build a rank's model by hand (the runtime
builds every chunk of a rank with `model.spec.build_chunk_specs`)."""

from nanotitan.model.spec import ModelShardSpec, build_chunk_specs


def build_shard_spec(cfg, pp_rank: int = 0, ep_rank: int = 0) -> ModelShardSpec:
    """The spec of this rank's pipeline stage (its first model chunk when the schedule is interleaved)."""
    return build_chunk_specs(cfg, pp_rank, ep_rank)[0]
