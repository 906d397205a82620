"""ParallelDims: a rank's (dp, pp, ep, cp, tp) coordinates, its neighbours and its process groups (docs/design.md §3).

rank = (((dp_rank * PP + pp_rank) * EP + ep_rank) * CP + cp_rank) * TP + tp_rank  — tp fastest (its ranks share a
node: TP talks every layer), then cp (the ring's P2P or Ulysses' all-to-all every attention layer: CP x TP ranks
are contiguous, one node first), then ep, pp, dp (Megatron's and torchtitan's order) — so the world is an
`arange(world).view(DP, PP, EP, CP, TP)` grid and every group is a slice of it (docs/tp.md, docs/cp.md). With
CP = TP = 1 it is docs/design.md §3's identity:
- TP group          fixed (dp, pp, ep, cp), varies tp  — the dense part's all-reduces / all-gathers / reduce-scatters
- CP group          fixed (dp, pp, ep, tp), varies cp  — attention's ring (or all-to-all) over a sequence's chunks
- EP group          fixed (dp, pp), varies (ep, cp, tp) — token all-to-all inside one stage of one replica; the
                    experts are folded over the CP and TP ranks too (Megatron's parallel folding: `moe_ep` shards)
- PP group          fixed (dp, ep, cp, tp), varies pp  — activations between stages
- expert-DP group   fixed (pp, ep, cp, tp), varies dp  — all-reduce of expert gradients
- non-expert-DP     fixed (pp, tp), varies (dp, ep, cp) — all-reduce of replicated (and TP-sharded) gradients: a
                    CP rank holds its own tokens' part of them, so CP joins the DP ranks (torchtitan's dp_shard x cp)
- stage             fixed pp, varies (dp, ep, cp, tp)  — gradients of params replicated over TP whose TP ranks
                    each hold a partial sum (norm weights under SP, the router, ...: parallel/tp.py)
Data: data rank = dp_rank * EP + ep_rank as without CP; the CP ranks of one data rank read the same sequences, each
only its own chunks (parallel/cp.py: `chunk_runs`).
The coordinate maths is pure (no process groups) so it can be tested exhaustively;
`build_groups()` makes every group once, in the same order on every rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal, get_args

import torch
import torch.distributed as dist

from ..config.layout import expert_ranks

GroupKind = Literal["ep", "pp", "expert_dp", "non_expert_dp", "tp", "stage", "cp", "ep_backward", "pp_backward"]
GROUP_KINDS: tuple[str, ...] = get_args(GroupKind)[:7]  # built by build_groups, for every job
# "ep_backward", "pp_backward": the EP and PP groups again (same ranks), for the backward lane of
# parallel.ep_overlap_microbatches only (build_backward_ep_groups)


@dataclass
class ParallelDims:
    dp: int
    pp: int
    ep: int
    rank: int = 0
    groups: dict = field(default_factory=dict, compare=False, repr=False)
    tp: int = 1
    cp: int = 1

    def __post_init__(self):
        for name, v in (("dp", self.dp), ("pp", self.pp), ("ep", self.ep), ("tp", self.tp), ("cp", self.cp)):
            if v < 1:
                raise ValueError(f"parallel.{name}={v} must be >= 1 (--parallel.{name})")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world dp*pp*ep*cp*tp = "
                             f"{self.dp}*{self.pp}*{self.ep}*{self.cp}*{self.tp} = {self.world_size}")

    # --- coordinates ---------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.ep * self.cp * self.tp

    def grid(self) -> torch.Tensor:
        return torch.arange(self.world_size).view(self.dp, self.pp, self.ep, self.cp, self.tp)

    def coords(self, rank: int | None = None) -> tuple[int, int, int]:
        """(dp, pp, ep) of `rank` (its cp and tp coordinates: `cp_of`, `tp_of`)."""
        r = (self.rank if rank is None else rank) // (self.cp * self.tp)
        return r // (self.pp * self.ep), (r // self.ep) % self.pp, r % self.ep

    def tp_of(self, rank: int) -> int:
        return rank % self.tp

    def cp_of(self, rank: int) -> int:
        return rank // self.tp % self.cp

    def rank_of(self, dp_rank: int, pp_rank: int, ep_rank: int, tp_rank: int | None = None) -> int:
        """The global rank at these coordinates; tp_rank None: this rank's own tp coordinate (so that code written
        for three axes finds its neighbours on the same TP slice); always this rank's own cp coordinate."""
        t = self.tp_rank if tp_rank is None else tp_rank
        return (((dp_rank * self.pp + pp_rank) * self.ep + ep_rank) * self.cp + self.cp_rank) * self.tp + t

    @property
    def dp_rank(self) -> int:
        return self.coords()[0]

    @property
    def pp_rank(self) -> int:
        return self.coords()[1]

    @property
    def ep_rank(self) -> int:
        return self.coords()[2]

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def cp_rank(self) -> int:
        return self.cp_of(self.rank)

    @property
    def moe_ep(self) -> int:
        """Ranks the experts of a stage are sharded over: EP folded with CP and TP (docs/tp.md, docs/cp.md)."""
        return expert_ranks(self.ep, self.cp, self.tp)

    @property
    def moe_ep_rank(self) -> int:
        """This rank's place among them: its shard of the experts is [moe_ep_rank * L, (moe_ep_rank + 1) * L)."""
        return (self.ep_rank * self.cp + self.cp_rank) * self.tp + self.tp_rank

    @property
    def is_pp_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_pp_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def prev_pp_rank(self) -> int | None:
        """Global rank of the previous stage (same dp, ep), None on the first stage."""
        d, p, e = self.coords()
        return None if p == 0 else self.rank_of(d, p - 1, e)

    @property
    def next_pp_rank(self) -> int | None:
        d, p, e = self.coords()
        return None if p == self.pp - 1 else self.rank_of(d, p + 1, e)

    @property
    def data_rank(self) -> int:
        """Which shard of the global batch this rank reads: DP and EP read disjoint data, PP does not."""
        return self.dp_rank * self.ep + self.ep_rank

    @property
    def data_world(self) -> int:
        return self.dp * self.ep

    @property
    def loss_copies(self) -> int:
        """How many ranks hold each microbatch's loss: the TP ranks of the last stage each hold the same sum, so a
        SUM over the world counts every microbatch this many times (parallel/step.py divides it out). The CP ranks
        each hold their own tokens' part of it (parallel/cp.py): their sum is the microbatch's, counted once."""
        return self.tp

    @property
    def stat_copies(self) -> int:
        """How many ranks hold each microbatch's router statistics (balance and z losses, expert counts): every
        token rank holds the whole microbatch's (model/moe.py sums them over TP x CP)."""
        return self.tp * self.cp

    # --- group membership (global ranks, sorted) ----------------------------------------------
    def all_group_ranks(self, kind: GroupKind) -> list[list[int]]:
        """Every group of one kind, as lists of global ranks, in a fixed order: slices of `grid()`, in plain ints
        (no tensor: `nanotitan plan --dry-run` asks while a FakeTensorMode turns every new tensor into a fake)."""
        D, P, E, C, T = range(self.dp), range(self.pp), range(self.ep), range(self.cp), range(self.tp)

        def r(d, p, e, c, t):
            return (((d * self.pp + p) * self.ep + e) * self.cp + c) * self.tp + t
        if kind in ("ep", "ep_backward"):
            return [[r(d, p, e, c, t) for e in E for c in C for t in T] for d in D for p in P]
        if kind in ("pp", "pp_backward"):
            return [[r(d, p, e, c, t) for p in P] for d in D for e in E for c in C for t in T]
        if kind == "expert_dp":
            return [[r(d, p, e, c, t) for d in D] for p in P for e in E for c in C for t in T]
        if kind == "non_expert_dp":
            return [[r(d, p, e, c, t) for d in D for e in E for c in C] for p in P for t in T]
        if kind == "tp":
            return [[r(d, p, e, c, t) for t in T] for d in D for p in P for e in E for c in C]
        if kind == "cp":
            return [[r(d, p, e, c, t) for c in C] for d in D for p in P for e in E for t in T]
        if kind == "stage":
            return [[r(d, p, e, c, t) for d in D for e in E for c in C for t in T] for p in P]
        raise ValueError(f"unknown group kind {kind!r}")

    def group_ranks(self, kind: GroupKind) -> list[int]:
        """The global ranks of this rank's group of `kind`."""
        (ranks,) = [r for r in self.all_group_ranks(kind) if self.rank in r]
        return ranks

    def place_like(self, ranks: list[int], peer: int) -> int:
        """`peer`'s place in its group of the kind whose group of this rank is `ranks` (a process group's ranks, in
        its order): every group of a kind is the same slice of the grid, so any rank's place in any group follows
        from the coordinates alone (optim/geometry.py computes a peer's shards with it, nothing exchanged)."""
        for kind in GROUP_KINDS:
            if self.group_ranks(kind) == list(ranks):
                (like,) = [g for g in self.all_group_ranks(kind) if peer in g]
                return like.index(peer)
        raise ValueError(f"ranks {list(ranks)} are no group of rank {self.rank}'s ParallelDims")

    # --- process groups --------------------------------------------------------------------
    def group(self, kind: GroupKind):
        """This rank's ProcessGroup of `kind` (None when the group is just this rank, or before
        build_groups on a world of one). An unknown kind raises: None would silently mean "no communication"."""
        if kind not in get_args(GroupKind):
            raise ValueError(f"unknown group kind {kind!r} (one of {', '.join(get_args(GroupKind))})")
        return self.groups.get(kind)

    def build_groups(self, timeout_s: float = 300.0, backend: str | None = None) -> "ParallelDims":
        """Create every group of every kind, same order on all ranks (new_group is collective)."""
        assert dist.is_initialized()
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"world size {dist.get_world_size()} != dp*pp*ep*cp*tp = {self.dp}*{self.pp}*{self.ep}*{self.cp}*"
                f"{self.tp} (set --parallel.dp/pp/ep/cp/tp so their product is the world size)")
        for kind in GROUP_KINDS:
            if (kind in ("tp", "stage") and self.tp == 1) or (kind == "cp" and self.cp == 1):
                continue  # TP's (CP's) groups only with TP (CP): a three-axis job builds the groups it always did
            for ranks in self.all_group_ranks(kind):
                pg = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s), backend=backend)
                if self.rank in ranks:
                    self.groups[kind] = pg if len(ranks) > 1 else None
        # without TP the stage's ranks are non-expert-DP's: every layout has a stage group, that one at tp = 1
        self.groups.setdefault("stage", self.groups.get("non_expert_dp"))
        return self

    def build_backward_ep_groups(self, timeout_s: float = 300.0) -> "ParallelDims":
        """parallel.ep_overlap_microbatches: the backward lane's groups, same order on all ranks (new_group is
        collective over the world). Every EP group a second time ("ep_backward"), so that a backward's all-to-alls
        never queue behind, or pair with, a forward's running at the same time on the same ranks (parallel/lanes.py:
        EPLanes.group); with pp > 1 every PP group a second time too ("pp_backward"), which carries the gradients
        while "pp" carries the activations, so each group's P2P messages are one lane's (parallel/lanes.py:
        two_lanes). (It builds both; the name is its caller's, parallel/parallelize.py.)"""
        if "ep_backward" in self.groups or not dist.is_initialized() or self.world_size == 1:
            return self
        for kind in ("ep_backward", "pp_backward") if self.pp > 1 else ("ep_backward",):
            for ranks in self.all_group_ranks(kind):
                pg = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))
                if self.rank in ranks:
                    self.groups[kind] = pg if len(ranks) > 1 else None
        return self


def init_distributed(backend: str, rank: int, world: int, timeout: timedelta, device: torch.device) -> None:
    """init_process_group on torchrun's store, with every key namespaced by the restart attempt.

    After a rank dies and torchrun restarts the group, the new ranks would otherwise find the addresses
    their dead predecessors published and gloo would try to connect to closed ports (seen here: "Connection
    refused" two seconds into the restart, or a hang in new_group).
    """
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # the agent hosts the store
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_store, timeout=timeout, wait_for_workers=False)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"nanotitan/attempt_{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
