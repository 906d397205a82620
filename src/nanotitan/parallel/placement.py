"""Which expert each slot of each EP rank holds: a MoE layer's expert shard (`EPShard`: the identity placement when
static, expert e in slot e % L of rank e // L), the routes by it, and experts placed by load
(parallel.expert_placement=balanced, docs/ep.md "Experts placed by load"): the rule.

The rule is pure functions of a window's routing counts, so every rank computes the same placement from the same
all-reduced counts. Shape legend as in ep.py: E experts, P EP ranks (dims.moe_ep), L = E/P home slots per rank, C = L +
spare
slots per rank (spare = parallel.expert_replicas - 1), R replicas at most.

A placement is a table slots[p][s] = the global expert whose weights EP rank p's slot s holds (-1: empty). Every
expert has at least one slot; a replicated expert's copies all sit in ONE spare column s >= L (the same slot index
on each of its ranks), so that whatever way the gradient sync shards an expert tensor over DP, the copies' pieces
are the same elements on every EP rank (rebalance.py sums them without regathering).

The rule (`balanced`):
  1. replicas, EPLB's: while some copy carries more than REPLICATE_ABOVE x the mean expert load, the expert with
     the heaviest copy (load / copies; ties to the lower id) gets one more copy, if it has fewer than R and its
     spare column (the one with the most free slots, at its first copy) has room;
  2. LPT: the replicated experts' copies first, heaviest first, on the least-loaded ranks (ties to the lower
     rank) of their column, of one node where it has room (below); then the other experts, heaviest first, each
     on a rank with a free slot of the node that would carry least per rank, its least-loaded one. Cold experts
     end up sharing a rank with others; a copy's load here is load / copies (the dispatch cuts it finer).
Nodes (`nodes[p]`: the node of EP rank p, from the emulated or real hosts): a replicated expert's copies go to the
ranks of one node where its column has room there (EPLB's hierarchical rule), so the copies' gradient sum and the
moves between them ride the node's fast link, not the network; `sticky` relabels ranks only node for node.
The tokens (`Placement.route`, per microbatch, from every source's counts, which the dispatch exchanges anyway):
a replicated expert's n assignments are cut over its copies where they even out the ranks' loads *this
microbatch* (water-filled over its copies' ranks after the single experts, heaviest expert first), not in fixed
1/r shares: a placement made from one window still balances the next, as long as the experts that turned hot
have copies. Each source gives each copy the same fraction of its own assignments, in token order. Every
assignment is still computed once by e's weights, so the maths is unchanged; only where it runs moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import permutations
from typing import Callable

import torch

REPLICATE_ABOVE = 0.75  # a copy heavier than this x the mean expert load is split further while its column has room
KEEP_WITHIN = 0.02  # a new placement is adopted only if it cuts the busiest rank's load by more than this share


@dataclass(frozen=True)
class Placement:
    slots: tuple[tuple[int, ...], ...]  # slots[p][s]: global expert id, -1 empty
    num_experts: int

    @property
    def P(self) -> int:
        return len(self.slots)

    @property
    def C(self) -> int:
        return len(self.slots[0])

    def copies(self) -> list[list[tuple[int, int]]]:
        """copies[e]: e's (rank, slot)s in rank order (a replicated expert's share c is its c-th copy). Read only."""
        return self._copies

    @cached_property
    def _copies(self) -> list[list[tuple[int, int]]]:  # made once a placement: the dispatch asks every call
        out: list[list[tuple[int, int]]] = [[] for _ in range(self.num_experts)]
        for p, row in enumerate(self.slots):
            for s, e in enumerate(row):
                if e >= 0:
                    out[e].append((p, s))
        return out

    @cached_property
    def single(self) -> bool:
        """Every expert in one slot (the identity placement, a balanced one without copies): a slot takes all its
        expert's assignments, no cut."""
        return all(len(c) == 1 for c in self.copies())

    @cached_property
    def in_order(self) -> bool:
        """`single`, and the global slots p*C + s ascend with the expert id (the identity placement): the packed
        expert-major order is already the send order."""
        slots = [p * self.C + s for c in self.copies() for p, s in c]
        return self.single and slots == sorted(slots)

    @cached_property
    def expert_of_slot(self) -> torch.Tensor:
        """[P*C] int64 on the host: the expert of each global slot p*C + s, E for an empty one (made once)."""
        return torch.tensor([e if e >= 0 else self.num_experts for row in self.slots for e in row], dtype=torch.long)

    def parts(self, load_E: list) -> tuple[list, list[list]]:
        """(each rank's load, parts[e]: e's load per copy, copies in rank order) when this microbatch's (or window's)
        load is placed: the single experts where they sit, then each replicated expert, heaviest first (ties to the
        lower id), water-filled over its copies' ranks. Integer loads give integer parts (the dispatch's cuts)."""
        copies = self.copies()
        rank = [0] * self.P
        parts: list[list] = [[load_E[e]] if len(c) == 1 else [] for e, c in enumerate(copies)]
        for e, c in enumerate(copies):
            if len(c) == 1:
                rank[c[0][0]] += load_E[e]
        for e in sorted((e for e, c in enumerate(copies) if len(c) > 1), key=lambda e: (-load_E[e], e)):
            parts[e] = water_fill(load_E[e], [rank[p] for p, _ in copies[e]])
            for (p, _), z in zip(copies[e], parts[e]):
                rank[p] += z
        return rank, parts

    def rank_loads(self, load_E: list) -> list:
        """Each rank's load, the replicated experts' tokens cut as the dispatch cuts them (`parts`)."""
        return self.parts(load_E)[0]

    def imbalance(self, load_E: list) -> float:
        """Busiest rank / mean rank."""
        loads = self.rank_loads(load_E)
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean > 0 else 1.0

    def replicated(self) -> list[tuple[int, int, list[int]]]:
        """(expert, column, ranks) of every expert with more than one copy."""
        return [(e, c[0][1], [p for p, _ in c]) for e, c in enumerate(self.copies()) if len(c) > 1]

    def tables(self, device) -> torch.Tensor:
        """The dispatch's device table (`slot_ids`): slot_of [E + 1, R_max], the global slot ids p*C + s of each
        expert's copies in rank order (row E: the dropped assignments' P*C, past every slot; unused: P*C)."""
        return self._slot_of.to(device)

    @cached_property
    def _slot_of(self) -> torch.Tensor:  # on the host, made once (`route` reads it every call); read only
        copies = self.copies()
        R = max(len(c) for c in copies)
        PC = self.P * self.C
        slot_of = torch.full((self.num_experts + 1, R), PC, dtype=torch.long)
        for e, c in enumerate(copies):
            slot_of[e, :len(c)] = torch.tensor([p * self.C + s for p, s in c])
        return slot_of

    def route(self, counts_PE: torch.Tensor, me: int) -> tuple[list[list[int]], list[list[int]], torch.Tensor]:
        """One microbatch's routes from every source's counts (counts_PE [P, E], int64 on the host: what source q
        sends to expert e): (send[p][s], what this rank `me` sends to rank p's slot s; recv[q][s], what it receives
        from source q into its slot s; start_of [E + 1, R_max], where copy c's assignments begin among this source's
        n of expert e, in token order: `slot_ids`'s cuts). Expert e's load is cut into `parts`, and every source
        gives each copy the same fraction of its own assignments (floor of the cumulative share): each copy then
        receives the same mix of near and far sources, so the bytes on a node's link even out as the loads do.
        The same on every rank (a function of the counts); vectorised over sources, experts and copies."""
        P, C, E = self.P, self.C, self.num_experts
        copies = self.copies()
        R = max(len(c) for c in copies)
        load = counts_PE.sum(0)
        _, parts = self.parts(load.tolist())
        upto = torch.zeros(E, R + 1, dtype=torch.long)  # upto[e, c]: e's parts of copies before c (then e's load)
        for e, part in enumerate(parts):
            upto[e, 1:len(part) + 1] = torch.tensor(part).cumsum(0)
            upto[e, len(part) + 1:] = upto[e, len(part)]
        cut = counts_PE[:, :, None] * upto[None] // load.clamp_min(1)[None, :, None]  # [P, E, R + 1]
        over = cut[:, :, 1:] - cut[:, :, :-1]  # [P, E, R]: what source q sends to e's copy c
        slot = self._slot_of[:E]  # [E, R]; unused copies point past the slots (P*C) with zero counts
        flat = torch.zeros(P, P * C + 1, dtype=torch.long).index_add_(1, slot.reshape(-1), over.reshape(P, -1))
        send = flat[me, :P * C].view(P, C).tolist()
        recv = flat[:, me * C:(me + 1) * C].tolist()
        dropped = torch.full((1, R), torch.iinfo(torch.long).max)  # row E: every dropped assignment in "copy" 0
        dropped[0, 0] = 0
        return send, recv, torch.cat([cut[me, :, :-1], dropped])


@dataclass(frozen=True)
class Route:
    """One microbatch's routes on one rank (`EPShard.route`): the dispatch's split sizes, and its cuts."""
    send: list[list[int]]  # send[p][s]: this rank's assignments to rank p's slot s
    recv: list[list[int]]  # recv[q][s]: source q's assignments to this rank's slot s
    start_of: torch.Tensor  # [E + 1, R_max] on the host: where copy c's assignments of expert e begin (`slot_ids`)


class EPShard:
    """One MoE layer's routed experts over the EP ranks (dims.moe_ep of them: EP folded with CP and TP), as rank
    `rank` holds them: a placement's table, the identity one when static (one rank included), a balanced one after
    a move (`swap`). The model holds it (model/experts.py: `ExpertShard`, handed in at build: its slots, spares
    included, sized and initialised from it); the EP dispatch routes by it (`route`, `slot_major`); the gradient
    sync reads its copies' rows (`copy_rows`, `extra_rows`: parallel/rebalance.py's `CopyFold`, shard.py's layout)."""

    def __init__(self, placement: Placement, rank: int):
        self.placement, self.rank = placement, rank
        self.moves = 0  # tables swapped in so far: who reads the copies' rows re-reads them after a change
        self._device_tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._static_host: tuple[torch.Tensor, torch.Tensor] | None = None  # static dispatch's, made on first ask

    @property
    def P(self) -> int:
        return self.placement.P

    @property
    def C(self) -> int:
        return self.placement.C

    def experts_at(self, rank: int) -> tuple[int, ...]:
        """The global expert each slot of EP rank `rank` holds (-1: empty)."""
        return self.placement.slots[rank]

    def copy_rows(self) -> list[int]:
        """This rank's slots that a single expert does not hold alone: the empty ones and the copies of replicated
        experts (the DP reduction leaves them to the copies' fold, parallel/rebalance.py)."""
        n = [len(c) for c in self.placement.copies()]
        return [s for s, e in enumerate(self.placement.slots[self.rank]) if e < 0 or n[e] > 1]

    def extra_rows(self) -> list[int]:
        """This rank's copies of replicated experts that a copy on a lower rank also holds: after the fold every copy
        has the same gradient, counted once among them (by the first copy)."""
        return sorted(s for _, s, ranks in self.placement.replicated() if self.rank in ranks[1:])

    def swap(self, placement: Placement) -> None:
        """A move's new table (parallel/rebalance.py moved the weights and their optimizer state first)."""
        self.placement = placement
        self.moves += 1
        static = [k.removeprefix("static:") for k in self._device_tables if k.startswith("static:")]
        self._device_tables, self._static_host = {}, None
        for device in static:  # made again at once: a compiled dispatch reads them, never makes them
            self.static_tables(torch.device(device))

    @staticmethod
    def _host_tables(placement: Placement) -> tuple[torch.Tensor, torch.Tensor]:
        """`route_on_device`'s tables on the host, made before any traced call (apply_ep and `swap` ask for the static
        tables eagerly): a block compiled whole traces the dispatch, and dynamo cannot run a placement's cached
        properties' first call (their lock); read once here, they are plain attributes when traced."""
        with torch.device("cpu"):  # on the host even where the model is built on the meta device
            copies = torch.tensor([len(c) for c in placement.copies()], dtype=torch.long)
            _ = placement.in_order  # made now: the dispatch reads it
            return placement.tables("cpu"), copies

    def route(self, counts_PE: torch.Tensor) -> Route:
        """One microbatch's routes from every source's counts (counts_PE [P, E], int64 on the host: what source q
        sends to expert e; the same on every rank, so every rank computes the same routes). A single expert's slot
        takes all of its assignments; a replicated expert's are cut over its copies (`Placement.route`)."""
        if self.placement.single:  # the slot of each expert gets its column: no cut (what `Placement.route` gives)
            P, C, me = self.P, self.C, self.rank
            flat = torch.cat([counts_PE, counts_PE.new_zeros(P, 1)], 1)[:, self.placement.expert_of_slot]  # [P, P*C]
            return Route(flat[me].view(P, C).tolist(), flat[:, me * C:(me + 1) * C].tolist(),
                         torch.zeros(self.placement.num_experts + 1, 1, dtype=torch.long))
        return Route(*self.placement.route(counts_PE, self.rank))

    def route_on_device(self, counts_PE: torch.Tensor, expert_ids_TK: torch.Tensor, order_N: torch.Tensor,
                        counts_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The static dispatch's routes, every count on the device (counts_PE [P, E]: what source q sends to expert
        e, on the device; order_N: this rank's packed order, `pack_expert_major`): (slots_PG [P, P*C], what source q
        sends to global slot g = p*C + s; order_N slot-major, dropped assignments last). A replicated expert's
        assignments are cut over its r copies in equal shares, each source's in token order (copy c takes positions
        [c*n/r, (c+1)*n/r) of its n): not `Placement.route`'s water-fill, which reads the loads to the host. Every
        assignment is still computed once by its expert's weights: the maths is the same."""
        P, C, E = self.P, self.C, self.placement.num_experts
        slot_of, copies_E = self.static_tables(counts_PE.device)  # [E + 1, R] (unused: P*C), [E]
        R = slot_of.shape[1]
        c_1 = torch.arange(R + 1, device=counts_PE.device)
        upto_ER1 = torch.minimum(c_1[None, :], copies_E[:, None])  # copies before c, at most r
        cut_PER1 = counts_PE[:, :, None] * upto_ER1[None] // copies_E[None, :, None]  # [P, E, R + 1]
        over = (cut_PER1[:, :, 1:] - cut_PER1[:, :, :-1]).reshape(P, -1)  # [P, E*R]: source q to e's copy c
        slots_PG = counts_PE.new_zeros(P, P * C + 1).index_add_(1, slot_of[:E].reshape(-1), over)[:, :P * C]
        if self.placement.in_order:  # each expert's one slot, in expert order: nothing moves
            return slots_PG, order_N
        dropped = torch.full((1, R), torch.iinfo(torch.long).max, device=counts_PE.device)
        dropped[0, 0] = 0  # row E: every dropped assignment in "copy" 0, slot P*C (past every slot)
        start_of = torch.cat([cut_PER1[self.rank, :, :-1], dropped])
        slot_N = slot_ids(expert_ids_TK.reshape(-1), order_N, counts_E, slot_of, start_of)
        return slots_PG, order_N.index_select(0, torch.argsort(slot_N, stable=True))  # stable: token order per slot

    def static_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(`Placement.tables` [E + 1, R], copies per expert [E]) on `device`, made once a table; apply_ep makes them
        before any call (a block compiled whole would recompile once, its first trace having seen them missing)."""
        key = "static:" + str(device)
        if key not in self._device_tables:
            if self._static_host is None:  # static dispatch only: a dynamic one never builds them
                self._static_host = self._host_tables(self.placement)
            self._device_tables[key] = tuple(t.to(device) for t in self._static_host)
        return self._device_tables[key]

    def slot_major(self, expert_ids_TK: torch.Tensor, order_N: torch.Tensor, counts_E: torch.Tensor,
                   route: Route) -> torch.Tensor:
        """The packed assignments (`order_N`, expert-major: `pack_expert_major`) put slot-major: the send order
        (destination rank, then slot), token order kept within a slot; dropped assignments last."""
        if self.placement.in_order:  # each expert's one slot, in expert order: nothing moves
            return order_N
        slot_of, start_of = self._tables(order_N.device, route)
        slot_N = slot_ids(expert_ids_TK.reshape(-1), order_N, counts_E, slot_of, start_of)
        return order_N.index_select(0, torch.argsort(slot_N, stable=True))  # stable: token order per slot

    def _tables(self, device: torch.device, route: Route) -> tuple[torch.Tensor, torch.Tensor]:
        """`Placement.tables` on `device` (made once a table) and this microbatch's cuts there."""
        key = str(device)
        if key not in self._device_tables:
            self._device_tables[key] = self.placement.tables(device)
        return self._device_tables[key], route.start_of.to(device)


def expert_shards(cfg, dims) -> Callable[[int], EPShard]:
    """Each MoE layer's expert shard at build (the model is built with it: parallel/build.py): the identity placement
    over dims.moe_ep ranks, with parallel.expert_replicas - 1 empty spare slots per rank under a balanced placement
    (a move fills them with copies)."""
    p, E = cfg.parallel, cfg.model.num_experts
    spare = p.expert_replicas - 1 if p.expert_placement == "balanced" and dims.moe_ep > 1 else 0
    return lambda layer: EPShard(identity(E, dims.moe_ep, spare), dims.moe_ep_rank)


def identity(num_experts: int, P: int, spare: int = 0) -> Placement:
    """The static placement: expert e on rank e // L, slot e % L; spare slots empty."""
    L = num_experts // P
    return Placement(tuple(tuple(p * L + s for s in range(L)) + (-1,) * spare for p in range(P)), num_experts)


def _replica_counts(load_E: list[float], P: int, L: int, spare: int, R: int) -> tuple[list[int], list[int]]:
    """Step 1: (copies per expert, spare column per expert or -1)."""
    E = len(load_E)
    n, column = [1] * E, [-1] * E
    free = [P] * spare  # free slots per spare column
    mean = sum(load_E) / E
    done = [False] * E
    while True:
        live = [e for e in range(E) if not done[e]]
        e = max(live, key=lambda e: (load_E[e] / n[e], -e), default=-1)
        if e < 0 or load_E[e] / n[e] <= REPLICATE_ABOVE * mean:
            break
        if n[e] >= R:
            done[e] = True
            continue
        if column[e] < 0:  # its first extra copy: the copies move to a spare column with room for two
            c = max(range(spare), key=lambda c: (free[c], -c), default=-1)
            if c < 0 or free[c] < 2:
                done[e] = True
                continue
            column[e], free[c] = c, free[c] - 2
        elif free[column[e]] >= 1:
            free[column[e]] -= 1
        else:
            done[e] = True
            continue
        n[e] += 1
    return n, column


def balanced(load_E: list[float], P: int, spare: int = 0, R: int = 1, nodes: list[int] | None = None) -> Placement:
    """The LPT placement of `load_E` over P ranks of L + spare slots (module docstring); `nodes[p]`: EP rank p's node
    (None: one node), where a replicated expert's copies stay together when its column has room on one node."""
    E = len(load_E)
    L = E // P
    nodes = nodes or [0] * P
    n, column = _replica_counts(load_E, P, L, spare, R)
    slots = [[-1] * (L + spare) for _ in range(P)]
    rank_load = [0.0] * P
    replicated = sorted((e for e in range(E) if n[e] > 1), key=lambda e: (-load_E[e] / n[e], e))
    for e in replicated:
        s = L + column[e]
        free = sorted((p for p in range(P) if slots[p][s] < 0), key=lambda p: (rank_load[p], p))
        # the node whose n[e] least-loaded free ranks are the least loaded in all; none with room: any ranks
        fits = {nd: [p for p in free if nodes[p] == nd][:n[e]] for nd in sorted(set(nodes))}
        fits = [r for r in fits.values() if len(r) == n[e]]
        ranks = min(fits, key=lambda r: (sum(rank_load[p] for p in r), r)) if fits else free[:n[e]]
        for p in ranks:
            slots[p][s] = e
            rank_load[p] += load_E[e] / n[e]
    size = {nd: nodes.count(nd) for nd in nodes}

    def node_mean(p: int, extra: float) -> float:  # what p's node would carry a rank: its copies even it out
        return (sum(rank_load[q] for q in range(P) if nodes[q] == nodes[p]) + extra) / size[nodes[p]]
    for e in sorted((e for e in range(E) if n[e] == 1), key=lambda e: (-load_E[e], e)):
        p = min((p for p in range(P) if -1 in slots[p]), key=lambda p: (node_mean(p, load_E[e]), rank_load[p], p))
        slots[p][slots[p].index(-1)] = e
        rank_load[p] += load_E[e]
    return Placement(tuple(tuple(row) for row in slots), E)


def sticky(old: Placement, new: Placement, nodes: list[int] | None = None) -> Placement:
    """`new` with its ranks relabelled and each rank's unreplicated experts kept in their old slots, so that as few
    experts as possible change (rank, slot): the loads are the same (ranks are interchangeable), the move smaller
    (rebalance.py sends and rewrites only the slots that change). The relabelling maximises the experts a rank
    keeps (every permutation up to 7 ranks, else greedily); a replicated expert's column stays as it is. With
    `nodes`, only relabellings that map whole nodes onto whole nodes: copies placed on one node stay on one."""
    P = new.P
    nodes = nodes or [0] * P
    keep = [[len((set(new.slots[q]) & set(old.slots[p])) - {-1}) for p in range(P)] for q in range(P)]

    def node_for_node(perm) -> bool:  # ranks on one node go to ranks on one node, two nodes to two
        pairs = {(nodes[q], nodes[p]) for q, p in enumerate(perm)}
        return len(pairs) == len({a for a, _ in pairs}) == len({b for _, b in pairs})
    if P <= 7:
        to = max((perm for perm in permutations(range(P)) if node_for_node(perm)),
                 key=lambda perm: (sum(keep[q][perm[q]] for q in range(P)), [-x for x in perm]))
    else:  # greedily: each node onto the free node of its size that keeps most, then rank for rank within it
        to, ranks_of = [0] * P, {}
        for p, nd in enumerate(nodes):
            ranks_of.setdefault(nd, []).append(p)
        free_nodes = set(ranks_of)
        for nd, qs in ranks_of.items():
            m = max((m for m in free_nodes if len(ranks_of[m]) == len(qs)),
                    key=lambda m: (sum(max(keep[q][p] for p in ranks_of[m]) for q in qs), -m))
            free_nodes.discard(m)
            free = set(ranks_of[m])
            for q in qs:
                to[q] = max(free, key=lambda p: (keep[q][p], -p))
                free.discard(to[q])
    n = [len(c) for c in new.copies()]
    rows: list[tuple[int, ...]] = [()] * P
    for q, p in enumerate(to):
        row = [e if e >= 0 and n[e] > 1 else -1 for e in new.slots[q]]  # the replicas' columns stay
        rest = [e for e in new.slots[q] if e >= 0 and n[e] == 1]
        for e in list(rest):
            s = old.slots[p].index(e) if e in old.slots[p] else -1
            if s >= 0 and row[s] == -1:
                row[s] = e
                rest.remove(e)
        for e in rest:
            row[row.index(-1)] = e
        rows[p] = tuple(row)
    return Placement(tuple(rows), new.num_experts)


def choose(current: Placement, load_E: list[float], R: int, nodes: list[int] | None = None) -> Placement:
    """The next placement: `balanced` on this window's load (made `sticky` to the current one), unless it beats the
    current one's busiest rank by no more than KEEP_WITHIN (a balanced router then keeps its placement: no moves)."""
    new = sticky(current, balanced(load_E, current.P, current.C - current.num_experts // current.P, R, nodes), nodes)
    if max(new.rank_loads(load_E)) < (1 - KEEP_WITHIN) * max(current.rank_loads(load_E)):
        return new
    return current


def water_fill(n, loads: list) -> list:
    """n elements shared over len(loads) takers so that the highest load + share is as low as integers allow: share
    i = max(0, t - loads[i]) at the level t where the shares sum to n (the remainder to the least loaded, then the
    lower index); non-integer loads get the exact level."""
    order = sorted(range(len(loads)), key=lambda i: (loads[i], i))
    for k in range(len(order), 0, -1):  # the most takers whose level reaches the k-th lowest load
        low = [loads[i] for i in order[:k]]
        if n + sum(low) >= k * low[-1]:
            break
    if not all(isinstance(x, int) for x in (n, *loads)):  # a window's weighted load: the level itself
        t = (n + sum(low)) / k
        return [max(0.0, t - x) if i in order[:k] else 0.0 for i, x in enumerate(loads)]
    t, extra = divmod(n + sum(low), k)
    share = [0] * len(loads)
    for j, i in enumerate(order[:k]):
        share[i] = t - loads[i] + (j < extra)
    return share


def dp_shares(placements: list[Placement], rows: list[list[int]], balance: bool) -> list[dict[int, list[list[int]]]]:
    """How each replicated expert's DP reduction splits over its copies at zero 0 (rebalance.py: CopyFold's fold): per
    layer, {expert: one list per tensor of the bounds [0, ..., n] of each copy's share of its row, copies in rank
    order}; `rows[layer]` are the row sizes (elements) of its tensors. `balance`: water-filled so that every EP rank
    reduces as many elements over DP as the rows allow (its single experts' rows, which the DP reduction carries,
    plus its shares); else 1/r each. The same on every rank: a function of the placements (none on a pipeline stage
    of dense layers only)."""
    if not placements:
        return []
    load = [0] * placements[0].P
    if balance:
        for pl, sizes in zip(placements, rows):
            n = [len(c) for c in pl.copies()]
            for p, row in enumerate(pl.slots):
                load[p] += sum(sizes) * sum(1 for e in row if e >= 0 and n[e] == 1)
    out = []
    for pl, sizes in zip(placements, rows):
        layer = {}
        for e, _, ranks in pl.replicated():
            layer[e] = []
            for n in sizes:
                part = water_fill(n, [load[q] for q in ranks]) if balance else \
                    [(c + 1) * n // len(ranks) - c * n // len(ranks) for c in range(len(ranks))]
                for q, z in zip(ranks, part):
                    load[q] += z
                layer[e].append([sum(part[:c]) for c in range(len(part) + 1)])
        out.append(layer)
    return out


def slot_ids(flat_ids_N: torch.Tensor, order_N: torch.Tensor, counts_E: torch.Tensor, slot_of: torch.Tensor,
             start_of: torch.Tensor) -> torch.Tensor:
    """Global slot id (p*C + s) of every packed assignment, in the expert-major order `order_N` (pack_expert_major);
    dropped assignments (id E) get P*C. Copy c of expert e takes this source's assignments of e from position
    start_of[e, c] on (token order: the packed order is stable; `Placement.route` makes the cuts). Vectorised: no
    loop over tokens or experts."""
    E = counts_E.numel()
    e_N = flat_ids_N.index_select(0, order_N)  # expert of each packed assignment (E: dropped)
    counts_x = torch.cat([counts_E, counts_E.new_zeros(1)])
    start_x = counts_x.cumsum(0) - counts_x
    pos_N = torch.arange(e_N.numel(), device=e_N.device) - start_x[e_N]  # place in its expert's run
    copy_N = (pos_N[:, None] >= start_of.index_select(0, e_N)[:, 1:]).sum(1)
    return slot_of[e_N, copy_N]
