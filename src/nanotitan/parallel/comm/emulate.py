"""Network emulation: every collective and P2P completes no earlier than its start plus the time a modelled link
would take for its bytes, so one CPU machine behaves like a cluster of nodes (docs/emulate.md).

    parallel.emulate            a hardware profile (hardware.py: h100-sxm, h800, ... or a profile JSON file)
    parallel.emulate_node_size  ranks per emulated node (0: the profile's devices_per_node); rank r on node r // G
    parallel.emulate_dilation   emulated seconds = modelled seconds / dilation; 0 (automatic): this CPU's GEMM peak /
                                the profile's peak, both in the job's dtype, so that compute and communication keep
                                the emulated cluster's ratio
Both zeros are made concrete by resolve.py (`resolve_emulation`), before any rank builds its LinkModel.

The link model uses hardware.py's conventions, the same formulas the planner prices a layout with. A group whose
ranks share one node runs on the profile's intra-node link; one that spans nodes on the inter-node link (the
slowest hop paces a ring). With n bytes over g ranks:
    all-reduce                  ring: 2(g-1)/g * n / allreduce_bw + 2(g-1) latency
    reduce-scatter, all-gather  half of that, n the unsharded buffer
    broadcast                   n / allreduce_bw + (g-1) latency (a pipelined ring)
    all-to-all                  this rank's bytes to (and from) peers on its node at the intra a2a_bw, to (and from)
                                peers on other nodes at the inter a2a_bw, the slower path bounds it; + (g-1) latency
    send, recv                  n / p2p_bw + latency of the link to the peer; a batch of them: the busiest
                                (peer, direction), directions being full duplex

`parallel/comm/collectives.py` asks for a deadline (`collective`, `all_to_all`, `p2p`: start + modelled time, 0.0 when
emulation is off) and holds the call until then (`hold`): a blocking call before it returns, an async one in its
`wait()`. So the hold is charged to the same per-axis wait columns and profiler labels as the call, and no value
changes. Each rank times its own call from its own start: a rank that waited for a late peer has already spent
that part of the modelled time (skew hides communication, where on a real network it would add to it).
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch.distributed as dist

from ...config.config import Config
from ...config.hardware import Hardware, Link, get_hardware, ring_allreduce_s, ring_half_s


@dataclass
class LinkModel:
    """The emulated cluster as seen from one rank: the profile's links, nodes of `node_size` ranks, the dilation."""
    hardware: Hardware
    node_size: int
    dilation: float
    rank: int = 0  # this process's global rank
    modelled_s: dict = field(default_factory=lambda: defaultdict(float))  # emulated seconds held for, per axis
    # When each axis's link is free again: calls in flight together on one axis (async all-to-alls, bucket
    # all-reduces) share its bandwidth, so a call posted while another is on the wire starts after it.
    busy_until: dict = field(default_factory=lambda: defaultdict(float))
    _ranks: dict = field(default_factory=dict, repr=False)  # id(group) -> (group, its global ranks)

    def node(self, rank: int) -> int:
        return rank // self.node_size

    def link(self, ranks) -> Link:
        """The intra-node link when all `ranks` share a node, else the inter-node one."""
        return self.hardware.intra if len({self.node(r) for r in ranks}) <= 1 else self.hardware.inter

    def group_ranks(self, group) -> list[int]:
        """Global ranks of `group` (None: the world), looked up once per group."""
        hit = self._ranks.get(id(group))
        if hit is None:  # the group itself is kept so that its id cannot be reused by another
            ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
            hit = self._ranks[id(group)] = (group, ranks)
        return hit[1]

    # --- modelled seconds of one call, on the emulated clock (already divided by the dilation) ---------------
    def collective_s(self, op: str, nbytes: int, ranks: list[int]) -> float:
        g, link = len(ranks), self.link(ranks)
        if op == "all-reduce":
            t = ring_allreduce_s(nbytes, g, link.allreduce_bw, link.latency_s)
        elif op in ("reduce-scatter", "all-gather"):
            t = ring_half_s(nbytes, g, link.allreduce_bw, link.latency_s)
        elif op == "broadcast":
            t = 0.0 if g < 2 else nbytes / link.allreduce_bw + (g - 1) * link.latency_s
        else:
            raise ValueError(f"no link model for collective {op!r}")
        return t / self.dilation

    def all_to_all_s(self, send_bytes: list[int], recv_bytes: list[int], ranks: list[int]) -> float:
        """send_bytes[i] / recv_bytes[i]: what this rank sends to / receives from ranks[i] (itself excluded)."""
        if len(ranks) < 2:
            return 0.0
        me = self.node(self.rank)
        local = [self.node(r) == me and r != self.rank for r in ranks]
        remote = [self.node(r) != me for r in ranks]
        hw = self.hardware

        def busiest(mask):  # the larger direction over the peers in mask
            return max(sum(b for b, m in zip(send_bytes, mask) if m), sum(b for b, m in zip(recv_bytes, mask) if m))

        t = max(busiest(local) / hw.intra.a2a_bw, busiest(remote) / hw.inter.a2a_bw)
        return (t + (len(ranks) - 1) * self.link(ranks).latency_s) / self.dilation

    def p2p_s(self, transfers: list[tuple[int, int, bool]]) -> float:
        """transfers: (peer global rank, bytes, is_send) of one call or one batch."""
        by_way: dict[tuple[int, bool], int] = defaultdict(int)
        for peer, nbytes, is_send in transfers:
            by_way[peer, is_send] += nbytes
        t = 0.0
        for (peer, _), nbytes in by_way.items():
            link = self.link((self.rank, peer))
            t = max(t, nbytes / link.p2p_bw + link.latency_s)
        return t / self.dilation

    def dilated(self, cpu: Hardware) -> Hardware:
        """`cpu` (the profile of the machine the ranks run on) with this network's links, dilated: what the planner
        predicts an emulated run with, given PlanOptions(link_node_size=node_size, links_idle=True)."""
        d = self.dilation

        def scaled(link: Link) -> Link:
            return Link(link.allreduce_bw * d, link.a2a_bw * d, link.p2p_bw * d, link.latency_s / d)

        return dataclasses.replace(cpu, name=f"{cpu.name} + emulated {self.hardware.name}",
                                   intra=scaled(self.hardware.intra), inter=scaled(self.hardware.inter))

    def describe(self) -> str:
        hw, d = self.hardware, self.dilation
        return (f"parallel.emulate: {hw.name} links, nodes of {self.node_size} ranks, dilation {d:.3g} (emulated "
                f"time = modelled / {d:.3g}): intra-node all-reduce bus {hw.intra.allreduce_bw * d / 1e9:.3g} GB/s, "
                f"latency {hw.intra.latency_s / d * 1e3:.3g} ms; inter-node {hw.inter.allreduce_bw * d / 1e9:.3g} "
                f"GB/s, {hw.inter.latency_s / d * 1e3:.3g} ms")


ACTIVE: LinkModel | None = None  # this process's emulated network (None: off); set once per rank by `install`


def install(model: LinkModel | None) -> LinkModel | None:
    """Emulate `model` for every later call of parallel/comm/collectives.py in this process (None: stop emulating)."""
    global ACTIVE
    ACTIVE = model
    return model


def emulated_peak_flops(hw: Hardware, dtype: str) -> float:
    """The emulated device's peak in the job's compute dtype (a bf16 job runs its GEMMs at the bf16 peak)."""
    return hw.peak_flops("bf16" if dtype == "bf16" else "fp32")


def link_model(cfg: Config, rank: int = 0) -> LinkModel | None:
    """The LinkModel of `parallel.emulate*` for global rank `rank` (None when parallel.emulate is empty), from the
    values resolve.py made concrete (`resolve_emulation`: the profile checked, the node size and the
    automatic dilation settled); here nothing is measured or chosen, the named profile is only looked up."""
    p = cfg.parallel
    if not p.emulate:
        return None
    assert p.emulate_node_size > 0 and p.emulate_dilation > 0, \
        "parallel.emulate_node_size/emulate_dilation are settled by resolve.py (resolve_emulation)"
    return LinkModel(get_hardware(p.emulate), p.emulate_node_size, p.emulate_dilation, rank)


# --- what collectives.py calls: a deadline per call, then the hold ---------------------------------------------------
def collective(t0: float, axis: str, op: str, nbytes: int, group) -> float:
    """Deadline (perf_counter seconds) of a collective that started at t0; 0.0 when emulation is off."""
    m = ACTIVE
    if m is None:
        return 0.0
    return _charge(m, axis, t0, m.collective_s(op, nbytes, m.group_ranks(group)))


def all_to_all(t0: float, axis: str, inp_bytes: int, rows: int, in_splits, out_splits, group) -> float:
    """Deadline of an all-to-all of `inp_bytes` in `rows` rows, split per peer by in_splits / out_splits
    (None: evenly)."""
    m = ACTIVE
    if m is None:
        return 0.0
    ranks = m.group_ranks(group)
    row = inp_bytes / rows if rows else 0.0
    even = [inp_bytes / len(ranks)] * len(ranks)
    send = [n * row for n in in_splits] if in_splits else even
    recv = [n * row for n in out_splits] if out_splits else even
    return _charge(m, axis, t0, m.all_to_all_s(send, recv, ranks))


def p2p(t0: float, axis: str, transfers: list[tuple[int, int, bool]]) -> float:
    """Deadline of sends/recvs started together at t0: (peer global rank, bytes, is_send) each."""
    m = ACTIVE
    if m is None:
        return 0.0
    return _charge(m, axis, t0, m.p2p_s(transfers))


def _charge(m: LinkModel, axis: str, t0: float, seconds: float) -> float:
    m.modelled_s[axis] += seconds
    done = max(t0, m.busy_until[axis]) + seconds  # queued behind what this axis already has on the wire
    m.busy_until[axis] = done
    return done


def hold(deadline: float) -> None:
    """Block until `deadline` (a perf_counter time; 0.0 or a past one: return at once)."""
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)
