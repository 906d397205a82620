"""Stall records: when a job hangs, which rank stopped and where every other rank waits for it.

Every collective and P2P call of `parallel/comm/collectives.py` enters this rank's record before it starts and leaves
it when it returns (an async one when its `wait()` returns): axis, op, the axis's sequence number on this
rank, the peers (group ranks, or the P2P neighbour), shapes, start and end time, and a context such as
"layer 2, backward" (the layer from `label_layers` hooks, the phase from autograd).

The record is a ring of the last SLOTS entries in a small memory-mapped file,
RUN_DIR/logs/comm_rank_N.ring, plus a heartbeat that a daemon thread refreshes twice a second. Because it
lives in the page cache, the launcher can read it after a failure even for a rank that is SIGSTOPped or
wedged in a C call and could never write anything itself: that rank's heartbeat stopped when it did.
A collective that raises (gloo's timeout after `parallel.timeout_s`, a closed connection) also writes
RUN_DIR/logs/stall_rank_N.json: the rank's last entries and the error, for a human.

`diagnose(log_dir, world)` turns the rings into the one line the launcher prints, e.g.
    rank 1 stalled: ranks 0,2,3 wait in EP all-to-all #532 (layer 2, backward); rank 1 last entered
    PP recv #530 (from rank 0) and is silent for 11 s (stopped or hung)

Cost: two `struct.pack_into` into the mapped page per call and cached encodings of its text (~2 us;
docs/reliability.md), nothing else.
Without `CommRecord.open` (in-process tests, benchmarks) the ring is a plain bytearray and there is no thread.

Fault injection (tests/run/test_faults.py): NANOTITAN_STOP_AT="RANK:AXIS:OP:SEQ" (OP may be empty: any op) makes
that rank SIGSTOP itself on entering that call, so a test can stall a chosen axis at a chosen point.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import struct
import threading
import time
from pathlib import Path

import torch

from ...config.errors import first_line

SLOTS = 64
HEARTBEAT_S = 0.5
IN_FLIGHT, DONE, FAILED = 0, 1, 2
# Header: magic, slots, rank, pid, world, timeout_s, started, heartbeat, entries so far.
_HEADER = struct.Struct("<8sIiiidddQ")
_HEADER_SIZE = 64
_MAGIC = b"NTRING1\0"
_HEARTBEAT_OFF = struct.calcsize("<8sIiiidd")
_COUNT_OFF = _HEARTBEAT_OFF + 8
# Slot: entry number, axis sequence number, start, end, state, axis, op, peers, shapes, context.
_SLOT = struct.Struct("<QQddB7s16s40s56s64s")
_SLOT_SIZE = 256
_END_OFF = struct.calcsize("<QQd")
_END = struct.Struct("<dB")
_COUNT = struct.Struct("<Q")
assert _HEADER.size <= _HEADER_SIZE and _SLOT.size <= _SLOT_SIZE


def ring_path(log_dir: str | Path, rank: int) -> Path:
    return Path(log_dir) / f"comm_rank_{rank}.ring"


def dump_path(log_dir: str | Path, rank: int) -> Path:
    return Path(log_dir) / f"stall_rank_{rank}.json"


# --- context: what the caller is doing (a layer), set by hooks ---------------------------------------

_context = ""  # one process, one record: a module variable (autograd's CPU backward runs on this thread)


def label_layers(model: torch.nn.Module) -> None:
    """Hooks that name the layer of every collective issued inside a transformer block: a forward pre-hook
    sets "layer i"; a gradient hook on the block's output sets it again when backward reaches that block.
    Cost: one attribute store per block call and one tensor hook per block per microbatch."""
    layers = getattr(model, "layers", None)
    if layers is None:
        return
    for key, block in layers.items():
        label = f"layer {key}"

        # Each hook sets the module variable itself (a helper call in each cost more than the assignment).
        def on_input(m, args, label=label):
            global _context
            _context = label

        def on_grad(g, label=label):
            global _context
            _context = label

        def on_output(m, args, out, on_grad=on_grad):  # bound now: the loop rebinds on_grad
            x = out[0] if isinstance(out, tuple) else out
            if torch.is_tensor(x) and x.requires_grad:
                x.register_hook(on_grad)
        block.register_forward_pre_hook(on_input)
        block.register_forward_hook(on_output)


# --- the record ------------------------------------------------------------------------------------

class CommRecord:
    """This rank's ring of its last SLOTS collectives (see the module docstring)."""

    def __init__(self):
        self._buf = bytearray(_HEADER_SIZE + SLOTS * _SLOT_SIZE)
        self._file = None
        self.log_dir: Path | None = None
        self.rank = 0
        self._count = 0
        self._axis_seq: dict[str, int] = {}
        self._group_ranks: dict = {}
        self._heads: dict = {}  # (axis, op, group, peers, layer, phase) -> their encoded slot fields (`enter`)
        self._stop = threading.Event()
        self._stop_at: tuple | None = None
        now = time.time()
        _HEADER.pack_into(self._buf, 0, _MAGIC, SLOTS, 0, os.getpid(), 1, 0.0, now, now, 0)

    def open(self, log_dir: str | Path, rank: int, world: int, timeout_s: float) -> None:
        """Back the ring by RUN_DIR/logs/comm_rank_N.ring (readable by the launcher) and start the heartbeat."""
        self.close()
        self.log_dir, self.rank = Path(log_dir), rank
        self.log_dir.mkdir(parents=True, exist_ok=True)
        size = _HEADER_SIZE + SLOTS * _SLOT_SIZE
        with contextlib.suppress(FileNotFoundError):
            dump_path(self.log_dir, rank).unlink()  # an earlier attempt's dump
        fd = os.open(ring_path(self.log_dir, rank), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
            self._file = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._buf = self._file
        now = time.time()
        _HEADER.pack_into(self._buf, 0, _MAGIC, SLOTS, rank, os.getpid(), world, float(timeout_s), now, now, 0)
        self._count, self._axis_seq = 0, {}
        stop_at = os.environ.get("NANOTITAN_STOP_AT", "").split(":")
        self._stop_at = (stop_at[1], stop_at[2], int(stop_at[3])) \
            if len(stop_at) == 4 and stop_at[0] == str(rank) else None
        self._stop = threading.Event()
        threading.Thread(target=self._heartbeat, args=(self._stop, self._buf), daemon=True,
                         name="nanotitan-heartbeat").start()

    def close(self) -> None:
        self._stop.set()
        self._file = None  # the thread holds its own reference until it sees the event

    @staticmethod
    def _heartbeat(stop: threading.Event, buf) -> None:
        # Runs whenever the main thread is blocked in a C call (gloo and NCCL release the GIL), so a
        # silent heartbeat means the process is stopped or stuck holding the GIL.
        while not stop.wait(HEARTBEAT_S):
            with contextlib.suppress(ValueError):  # the map was closed under us at exit
                struct.pack_into("<d", buf, _HEARTBEAT_OFF, time.time())

    def _peers(self, group) -> bytes:
        if group is None:
            return b"all"
        ranks = self._group_ranks.get(group)
        if ranks is None:
            import torch.distributed as dist

            ranks = self._group_ranks[group] = ",".join(map(str, dist.get_process_group_ranks(group))).encode()
        return ranks

    def enter(self, axis: str, op: str, tensors, group=None, peers: str | None = None) -> int:
        """Record the start of a call; returns its ticket for `leave`/`fail`. Every text field comes from a cache
        of its encoded bytes (a step repeats the same few), read inline: a Python call per field cost more than
        the record itself on a busy host (the default 8-rank job makes ~55 calls per rank per step)."""
        n = self._count = self._count + 1
        seq = self._axis_seq[axis] = self._axis_seq.get(axis, 0) + 1
        # context: the layer (EP only: the one axis called from inside a block), then the phase
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward" if axis == "ep" else ""
        head_key = (axis, op, group, peers, _context if axis == "ep" else "", phase)
        head = self._heads.get(head_key)  # axis, op, peers and context encoded: one lookup, not four
        if head is None:
            head = self._heads[head_key] = (_encoded(axis), _encoded(op),
                                            _encoded(peers) if peers is not None else self._peers(group),
                                            _ctx(head_key[4:]))
        key = tensors[0].shape if not tensors[1:] else tuple(t.shape for t in tensors)
        shapes_b = _SHAPES.get(key) or _shapes(tensors, key)
        _SLOT.pack_into(self._buf, _HEADER_SIZE + (n % SLOTS) * _SLOT_SIZE, n, seq, time.time(), 0.0, IN_FLIGHT,
                        head[0], head[1], head[2], shapes_b, head[3])
        _COUNT.pack_into(self._buf, _COUNT_OFF, n)
        if self._stop_at is not None and self._stop_at[0] == axis and self._stop_at[1] in ("", op) \
                and self._stop_at[2] == seq:
            import signal

            os.kill(os.getpid(), signal.SIGSTOP)  # fault injection (module docstring)
        return n

    def leave(self, ticket: int, state: int = DONE) -> None:
        if self._count - ticket < SLOTS:  # its slot is not reused yet
            _END.pack_into(self._buf, _HEADER_SIZE + (ticket % SLOTS) * _SLOT_SIZE + _END_OFF, time.time(), state)

    def fail(self, ticket: int, error: BaseException) -> None:
        """The call raised: mark it, and write this rank's last entries and the error for a human."""
        self.leave(ticket, FAILED)
        if self.log_dir is None:
            return
        info = {"rank": self.rank, "pid": os.getpid(), "time": time.time(), "error": first_line(error),
                "entries": self.entries()[-16:]}
        with contextlib.suppress(OSError):
            tmp = dump_path(self.log_dir, self.rank).with_suffix(".tmp")
            tmp.write_text(json.dumps(info, indent=1))
            os.replace(tmp, dump_path(self.log_dir, self.rank))

    def call(self, axis: str, op: str, tensors, group=None, peers: str | None = None, done: bool = True) -> "_Call":
        """`with RECORD.call(...) as ticket:` around a blocking call (`done=False`: an async one, whose
        `wait()` leaves it)."""
        return _Call(self, self.enter(axis, op, tensors, group, peers), done)

    def entries(self) -> list[dict]:
        return _parse(bytes(self._buf))["entries"]


class _Call:
    """The context of `CommRecord.call`: a class, not a generator context manager (~3 us less per collective)."""
    __slots__ = ("record", "ticket", "done")

    def __init__(self, record: CommRecord, ticket: int, done: bool):
        self.record, self.ticket, self.done = record, ticket, done

    def __enter__(self) -> int:
        return self.ticket

    def __exit__(self, typ, error, tb) -> bool:
        if error is not None:
            self.record.fail(self.ticket, error)
        elif self.done:
            self.record.leave(self.ticket)
        return False  # an error propagates


# Encoded text of the slots' fields. Axis, op, peers and context come from a few dozen strings; shapes vary with
# EP's token counts, so that cache is emptied when it grows past _SHAPES_MAX.
_ENCODED: dict[str, bytes] = {}
_SHAPES: dict = {}
_SHAPES_MAX = 4096


def _encoded(text: str) -> bytes:
    b = _ENCODED.get(text)
    if b is None:
        b = _ENCODED[text] = text.encode()
    return b


def _shapes(tensors, key) -> bytes:
    """'64x128' per tensor, space-separated ('scalar' for 0-d), cached under `key` (the shapes)."""
    if len(_SHAPES) >= _SHAPES_MAX:
        _SHAPES.clear()
    b = _SHAPES[key] = " ".join("x".join(map(str, t.shape)) or "scalar" for t in tensors).encode()
    return b


_CTX: dict[tuple[str, str], bytes] = {}


def _ctx(key: tuple[str, str]) -> bytes:
    """(layer, phase) -> b'layer 2, backward' (either may be empty), cached."""
    b = _CTX[key] = ", ".join(p for p in key if p).encode()
    return b


RECORD = CommRecord()


# --- reading the rings (the launcher, after a failure) ---------------------------------------------

def _parse(raw: bytes) -> dict:
    magic, slots, rank, pid, world, timeout_s, started, heartbeat, count = _HEADER.unpack_from(raw, 0)
    entries = []
    for i in range(slots):
        n, seq, t0, t1, state, *text = _SLOT.unpack_from(raw, _HEADER_SIZE + i * _SLOT_SIZE)
        if n == 0 or n > count or count - n >= slots:
            continue
        axis, op, peers, shapes, ctx = (s.rstrip(b"\0").decode(errors="replace") for s in text)
        entries.append({"n": n, "axis": axis, "op": op, "seq": seq, "peers": peers, "shapes": shapes, "ctx": ctx,
                        "start": t0, "end": t1 or None, "state": ("in flight", "done", "failed")[state]})
    entries.sort(key=lambda e: e["n"])
    return {"magic": magic, "rank": rank, "pid": pid, "world": world, "timeout_s": timeout_s, "started": started,
            "heartbeat": heartbeat, "entries": entries}


def read_ring(path: str | Path) -> dict | None:
    """A rank's ring as {rank, pid, world, timeout_s, started, heartbeat, entries: [...]}; None if absent."""
    try:
        raw = Path(path).read_bytes()
    except OSError:
        return None
    if len(raw) < _HEADER_SIZE or raw[:8] != _MAGIC:
        return None
    return _parse(raw)


def describe(e: dict) -> str:
    """'EP all-to-all #532 (layer 2, backward)', 'PP recv #530 (from rank 0)'."""
    notes = [e["ctx"]] if e["ctx"] else []
    if e["axis"] == "pp" and e["peers"] and e["peers"][0].isalpha():
        notes.append(re.sub(r"(to|from) (\d+)", r"\1 rank \2", e["peers"]))
    return f"{e['axis'].upper()} {e['op']} #{e['seq']}" + (f" ({', '.join(notes)})" if notes else "")


def _peer_ranks(e: dict) -> set[int]:
    return {int(x) for x in re.findall(r"\d+", e["peers"])}


def _ranks(rs) -> str:
    rs = sorted(rs)
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ",".join(map(str, rs))


def diagnose(log_dir: str | Path, world: int, since: float = 0.0) -> str | None:
    """One line naming the stalled rank(s) and where the others wait, or None when the rings show no
    stall (no live rank waited in a call for at least half of timeout_s). Rings older than `since`
    (an earlier job's) are ignored.

    A stalled rank is one whose heartbeat went silent long before the others' (stopped, or stuck in C
    holding the GIL), or whose ring is missing; when every heartbeat is fresh, the ranks the waiters
    wait for that are not waiting themselves (behind, e.g. in an endless loop)."""
    rings = {}
    for r in range(world):
        ring = read_ring(ring_path(log_dir, r))
        if ring is not None and ring["started"] >= since:
            rings[r] = ring
    if not rings:
        return None
    timeout = max(ring["timeout_s"] for ring in rings.values())
    last_beat = max(ring["heartbeat"] for ring in rings.values())
    silent = {r: last_beat - ring["heartbeat"] for r, ring in rings.items()
              if ring["heartbeat"] < last_beat - max(2.0, 0.2 * timeout)}
    waiting = {}
    for r, ring in rings.items():
        if r in silent:
            continue
        # The call it is blocked in: the oldest one not done. Async all-reduces of later buckets may have been
        # issued after it (and the timeout may surface in one of their waits), but a group runs them in order.
        blocked = next((e for e in ring["entries"] if e["state"] != "done"), None)
        if blocked and (blocked["end"] or ring["heartbeat"]) - blocked["start"] >= 0.5 * timeout:
            waiting[r] = blocked
    if not waiting:
        return None
    stalled = sorted(set(silent) | (set(range(world)) - set(rings)))
    if not stalled:  # all alive: the ones the waiters need that are not in a call themselves
        stalled = sorted(set().union(*(_peer_ranks(e) for e in waiting.values())) - set(waiting)
                         if all(e["peers"] != "all" for e in waiting.values()) else set(range(world)) - set(waiting))
    by_call: dict[str, list[int]] = {}
    for r, e in sorted(waiting.items()):
        by_call.setdefault(describe(e), []).append(r)
    waits = " and ".join(f"{_ranks(rs)} {'wait' if len(rs) > 1 else 'waits'} in {what}" for what, rs in by_call.items())
    if not stalled:
        return f"no rank is behind but {waits} (mismatched collectives?)"
    about = []
    for r in stalled:
        ring = rings.get(r)
        if ring is None:
            about.append(f"rank {r} left no record")
            continue
        last = ring["entries"][-1] if ring["entries"] else None
        what = f"rank {r} last entered {describe(last)}" if last else f"rank {r} entered no collective yet"
        if last and last["state"] == "in flight":
            what += " and never left it"
        if r in silent:
            what += f", silent for {silent[r]:.0f} s (stopped or hung)"
        about.append(what)
    return f"{_ranks(stalled)} stalled: {waits}; " + "; ".join(about)
