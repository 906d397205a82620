"""parallel.ep_overlap_microbatches: two lanes, a forward beside a backward, so that each one's EP all-to-alls
travel while the other computes (docs/ep.md, "Two lanes").

The one home of the feature's runtime:
- `two_lanes`: any pipeline schedule (and, at pp == 1, plain gradient accumulation) run in two lanes, the forwards
  on a thread, the backwards (and zb1's W's) on the caller's, each in the schedule's order (pp/facts.py lane_orders);
  `_ThreadState` carries the caller's torch settings over to the forward lane's thread.
- `EPLanes`: what the EP dispatchers of one model shard share with the lanes (parallel/ep.py apply_ep makes one and
  hands it to every EPDispatcher): each lane's EP group, the recording of every blocked EP interval, and the
  backward lane's filler (the weight-gradient GEMMs run while a backward all-to-all travels, pp/runner.py
  `FillRunner`). The shard hands it to the pipeline runner (pp/schedules.py `Lanes`), which enters `recording` /
  `filling` on it and calls `run_schedule` / `account`; nothing here is a module global.
- The overlap figures: `exposed_ep_wait`, `lanes_overlap` and `account_step` (StepStats' ep_wait_s, ep_exposed_s,
  lanes_overlap_s, ep_waits), and `LaneMeans`, their means per step over a record's interval (the StepLogger's).
The per-lane router statistics are an option of the MoE layer (model/moe.py `lane_local_router_state`), which
apply_ep turns on; the backward lane's EP and PP groups are dims.py's "ep_backward" / "pp_backward".
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.overrides import _get_current_function_mode_stack

from ..model.moe import in_backward
from .comm import collectives as comm
from .pp.comms import StageComms
from .pp.facts import lane_orders, lane_window


# --- the EP side: groups, wait recording, the backward lane's filler ---------------------------------------------
class EPLanes:
    """Shared by the EP dispatchers of one model shard (parallel/ep.py): the forward lane's and the backward lane's
    EP group (the same group twice without the lanes), and two things the lanes' runtime sets for a step:

    waits (`recording`): one record per blocking EP call or wait, (lane 0 forward / 1 backward, start, end, kind,
    posted), kind "<phase>:<call>" with phase f (forward), b (backward), r (a checkpointed block's recompute: a
    forward call inside the backward) and call counts / dispatch / combine / trip (a chunked trip's wait); posted:
    when the call was made (== start for a blocking call; an async one's wait starts later). None: off.
    fill (`filling`): while a backward all-to-all is on the wire, run the weight-gradient GEMMs the backward has
    deferred so far; None: none. One backward at a time per shard (the backward lane)."""

    def __init__(self, group=None, backward_group=None):
        self.groups = (group, backward_group or group)
        self.waits: list | None = None
        self.fill: Callable[[], None] | None = None

    def group(self):
        """The EP group of the calling lane: groups[0] for forwards, groups[1] for backwards (`in_backward`: a
        checkpointed block's recompute is the backward lane's)."""
        groups = self.groups
        return groups[0] if groups[1] is groups[0] else groups[in_backward()]  # one group: no lookup per call

    @contextlib.contextmanager
    def recording(self, on: bool = True):
        """While inside, every EP call's blocked interval is appended to the list yielded (None and nothing
        recorded when not `on`: recording costs every EP call a timer)."""
        waits = [] if on else None
        self.waits = waits
        try:
            yield waits
        finally:
            self.waits = None

    @contextlib.contextmanager
    def filling(self, fill: Callable[[], None]):
        """While inside, a backward's EP all-to-all is posted async, fill() runs (the deferred weight-gradient GEMMs,
        model/wgrad.py), and only then is it waited for (parallel/ep.py)."""
        self.fill = fill
        try:
            yield
        finally:
            self.fill = None

    def run_schedule(self, run, comms: StageComms, M: int, pp: int, pp_rank: int, split: bool, backward_group,
                     least: int, schedule: str, V: int) -> None:
        """The pipeline runner's entry (pp/schedules.py `Lanes`): the step's schedule in two lanes (`two_lanes`)."""
        two_lanes(run, comms, M, pp, pp_rank, split, backward_group, least=least, schedule=schedule, V=V)

    def account(self, spans: list, waits: list | None) -> dict:
        """The pipeline runner's entry: a step's lane figures (`account_step`)."""
        return account_step(spans, waits)

    def wait(self, work, kind: str = "f:trip", posted: float | None = None) -> None:
        """Wait for an async EP call; the blocked interval goes to the recording, if any."""
        waits, t0 = self.waits, time.perf_counter()
        work.wait()
        if waits is not None:
            t1 = time.perf_counter()  # list.append: atomic across lanes
            waits.append((int(in_backward()), t0, t1, kind, t0 if posted is None else posted))


# --- the runtime ----------------------------------------------------------------------------------------------
class _ThreadState:
    """torch's thread-local settings that the forward lane's thread must take over from the caller: grad mode,
    intra-op threads (a different count could change a GEMM's split, and so its bits), the saved-tensor hooks
    (the trainer's SavedActivations meter on logged steps), the dispatch modes (its step-peak meter, which
    counts every op's output) and the function modes (its host-sync meter). Autocast is entered by the runner's forward
    itself
    (pp/runner.py `StageRunner.forward`)."""

    def __init__(self):
        self.grad = torch.is_grad_enabled()
        self.threads = torch.get_num_threads()
        self.hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.modes = _get_current_dispatch_mode_stack()
        self.function_modes = _get_current_function_mode_stack()  # the trainer's host-sync meter (host_syncs.py)

    @contextlib.contextmanager
    def entered(self):
        if torch.get_num_threads() != self.threads:  # torch inits a new thread to the global count itself;
            torch.set_num_threads(self.threads)  # setting it anyway would clear oneDNN's caches every step
        hooks = torch.autograd.graph.saved_tensors_hooks(*self.hooks) if self.hooks else contextlib.nullcontext()
        with torch.set_grad_enabled(self.grad), hooks, contextlib.ExitStack() as modes:
            for mode in (*self.function_modes, *self.modes):  # bottom of each stack first, as the caller entered them
                modes.enter_context(mode)
            yield


def _wait(posted) -> None:
    if posted is not None:
        posted.wait()


def two_lanes(run, comms: StageComms, M: int, pp: int, pp_rank: int, split: bool = False, backward_group=None,
              join_timeout_s: float = 60.0, least: int = 2, schedule: str = "1f1b", V: int = 1) -> None:
    """Any schedule (and, at pp == 1, plain gradient accumulation) in two lanes: a thread runs the stage's forwards
    in the schedule's order, this thread its backwards (and zb1's W's) in the schedule's order (`lane_orders`).
    `run` is the schedule's runner (pp/runner.py `StageRunner`; zb1's split stages a `SplitRunner`): its forward /
    backward / backward_input / weights_until.
    With L = `lane_window`, the k-th forward starts once the (k-L)-th backward is done, and a backward once its
    own forward is: so 1F1B's steady F(w+j) runs beside its B(j) (F(j+1) beside B(j) on the last stage and at
    pp == 1), interleaved's steady chunk-forward beside its chunk-backward likewise, and a stage holds at most L
    (chunk-)microbatches (the schedule's own count, but 2 on 1F1B's last stage). gpipe: L = M, every forward
    first (its definition); its backwards still fill their all-to-alls (pp/runner.py `FillRunner`).

    P2P: each lane owns one direction of each neighbour pair, on its own PP group: the forward lane sends its
    output to the next rank and receives its next input from the previous one (PP group "pp"), the backward lane
    sends its input gradient back and receives its next output gradient (`backward_group`, "pp_backward",
    dims.py). Each group's messages between two ranks are then one lane's, in the schedule's order at both ends
    (the order is the same on every rank, and interleaved's ring maps the last rank's chunk v onto the first's v+1
    in that order), so they match whatever the threads' interleaving. Each lane posts its send and its next
    receive as one batch and waits for it only before that next computation: a gloo send completes only once its
    receiver has posted the receive, and on interleaved's ring (PP2: the same peer both ways) two lanes that sent
    before they received would wait for each other. Neighbours agree at every phase boundary because there are no
    phases: each lane is one loop, and each message is sent once its microbatch is computed and received when its
    lane is ready. Deadlock-free: every wait is for an earlier step of the schedule (the one-at-a-time order meets
    every lane's constraint, so a cycle of waits cannot form).

    Exact: the backwards run one at a time in the schedule's order on this thread, as without the lanes, and zb1's
    W's keep their order (each W due after B(j), `weights_until(j + 1 - pp_rank)`, runs during B(j)'s all-to-alls
    when the fill is on, else during its gradient send; the rest at the end), so every .grad accumulates the same
    terms in the same order and the gradient sync's hooks fire in the same order (the final backward, or W, runs
    after every forward); a forward reads only the parameters, which no backward or W changes, and draws no random
    numbers.
    EP pairing: each lane's EP collectives go on its own EP group (`EPLanes.group`), in an order fixed by
    (schedule, pp, pp_rank, M, V), the same on every rank of an EP group; a checkpointed block's recompute runs
    inside its backward, so its collectives are the backward lane's, in order. Torch releases the GIL inside its
    ops and in gloo's waits (and the emulator's holds sleep), so while one lane waits for a trip the other computes.
    An exception in either lane stops both and is raised here (the first one); each lane checks for it before it
    waits for a receive, and a lane stuck in a call whose peer failed is left behind (a daemon thread) after
    join_timeout_s, never waited for forever."""
    assert pp == 1 or backward_group is not None, "lanes need dims.build_backward_ep_groups() first"
    _TwoLanes(run, comms, M, pp, pp_rank, split, backward_group, least, schedule, V).run(join_timeout_s)


class _TwoLanes:
    """One step of `two_lanes`: the orders, the window, and what the two lanes share (progress, errors)."""

    def __init__(self, run, comms: StageComms, M: int, pp: int, pp_rank: int, split: bool, backward_group,
                 least: int, schedule: str, V: int):
        self.runner, self.comms, self.M, self.pp_rank, self.split = run, comms, M, pp_rank, split
        self.backward_group = backward_group
        self.forward_order, self.backward_order = lane_orders(schedule, pp, M, V)
        self.total = len(self.forward_order)
        self.L = lane_window(pp, pp_rank, M, least, schedule, V)
        self.forward_index = {op: k for k, op in enumerate(self.forward_order)}
        self.cond = threading.Condition()
        self.done = {"F": 0, "B": 0}  # forwards, backwards completed
        self.errors: list[BaseException] = []
        self.state = _ThreadState()

    def run(self, join_timeout_s: float) -> None:
        lane = threading.Thread(target=self._forward_lane, name="nanotitan-forward-lane", daemon=True)
        lane.start()
        try:
            self._backwards()
        except BaseException as e:  # noqa: BLE001
            self._fail(e)
        lane.join(timeout=join_timeout_s if self.errors else None)
        if self.errors:
            raise self.errors[0]

    def _fail(self, e: BaseException) -> None:
        with self.cond:
            self.errors.append(e)
            self.cond.notify_all()

    def _wait_until(self, ready: Callable[[], bool]) -> bool:
        """Block until ready() or a lane has failed; False when one has."""
        with self.cond:
            self.cond.wait_for(lambda: ready() or self.errors)
            return not self.errors

    def _receives(self, order: list, k: int, ends: list[bool]) -> bool:
        """Does the k-th op of a lane take a message? (Not past the last op, nor where `ends` marks the chunk as the
        pipeline's first (forwards: tokens, no input) or last (backwards: the loss, no output gradient).)"""
        return k < self.total and not ends[order[k][0]]

    # --- the forward lane (its own thread) ------------------------------------------------------------------------
    def _forward_lane(self) -> None:
        try:
            with self.state.entered():
                self._forwards()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            self._fail(e)

    def _forwards(self) -> None:
        run, comms, order = self.runner, self.comms, self.forward_order
        # the first input; afterwards each forward's send and the next one's receive are posted together
        in_buf, _, posted = comms.post_exchange(None, None, self._receives(order, 0, run.first), False)
        for k, (v, i) in enumerate(order):
            if self.errors:
                return
            _wait(posted)  # this forward's input (and the previous output's send)
            if not self._wait_until(lambda: self.done["B"] > k - self.L):
                return
            out = run.forward(v, i, in_buf)
            self._forward_done(k)
            in_buf, _, posted = comms.post_exchange(out, None, self._receives(order, k + 1, run.first), False)
            out = None  # zb1's B retains the graph for W: no reference here may outlive that W
        _wait(posted)

    def _forward_done(self, k: int) -> None:
        run = self.runner
        with self.cond:
            self.done["F"] = k + 1
            self.cond.notify_all()
            # held: F done, B (zb1: W) not; a B under way still holds its microbatch's activations
            held = k + 1 - (run.w_done if self.split else self.done["B"])
            run.max_in_flight = max(run.max_in_flight, held)

    # --- the backward lane (the caller's thread) ------------------------------------------------------------------
    def _backwards(self) -> None:
        run, comms, order, group = self.runner, self.comms, self.backward_order, self.backward_group
        _, grad_buf, posted = comms.post_exchange(None, None, False, self._receives(order, 0, run.last), group=group)
        for j, (v, i) in enumerate(order):
            # the gradient of a microbatch cannot come before its forward has been sent
            if not self._wait_until(lambda: self.done["F"] > self.forward_index[v, i]):
                return
            _wait(posted)  # this backward's output gradient (and the previous input gradient's send)
            if self.split:  # zb1: the W's due after B(j) run in its all-to-alls (the fill), the rest during its send
                due = j + 1 - self.pp_rank
                grad_in = run.backward_input(i, grad_buf, due)
            else:
                grad_in, due = run.backward(v, i, grad_buf, is_last=j == self.total - 1), None
            _, grad_buf, posted = comms.post_exchange(None, grad_in, False, self._receives(order, j + 1, run.last),
                                                      group=group)
            if due is not None:
                run.weights_until(due)
            grad_in = None
            with self.cond:
                self.done["B"] = j + 1
                self.cond.notify_all()
        _wait(posted)
        if self.split:
            run.weights_until(self.M)  # the last pp_rank W's: nothing left to overlap with


# --- the overlap figures ----------------------------------------------------------------------------------------
def exposed_ep_wait(spans: list[tuple[str, float, float]], waits: list[tuple[int, float, float]]) -> float:
    """Seconds during which some EP call was pending and no lane computed.

    spans: every F/B/W computation (start, end); waits: every interval a lane spent blocked in an EP call or wait,
    each inside one of the spans (`EPLanes` records them). A lane computes while it is inside a span and not
    blocked. With one lane this is the summed EP wait; with two, a wait is exposed only while the other lane is
    blocked too, or idle between its spans."""
    events = [(t0, 1, 0) for _, t0, _ in spans] + [(t1, -1, 0) for _, _, t1 in spans]
    events += [(w[1], -1, 1) for w in waits] + [(w[2], 1, -1) for w in waits]
    events.sort(key=lambda e: e[0])
    computing = pending = 0
    exposed, last = 0.0, None
    for t, dc, dp in events:
        if last is not None and pending > 0 and computing <= 0:
            exposed += t - last
        computing, pending, last = computing + dc, pending + dp, t
    return exposed


def lanes_overlap(spans: list[tuple[str, float, float]]) -> float:
    """Seconds during which a forward and a backward ran at once."""
    events = sorted([(t0, k, 1) for k, t0, _ in spans] + [(t1, k, -1) for k, _, t1 in spans], key=lambda e: e[0])
    active = {"F": 0, "B": 0, "W": 0}
    both, last = 0.0, None
    for t, k, d in events:
        if last is not None and active["F"] > 0 and active["B"] > 0:
            both += t - last
        active[k] += d
        last = t
    return both


def account_step(spans: list[tuple[str, float, float]], waits: list) -> dict:
    """The lanes' figures of one step, as pp.StepStats' fields: ep_wait_s (EP waits summed over the lanes),
    ep_exposed_s (`exposed_ep_wait`), lanes_overlap_s (`lanes_overlap`) and ep_waits (the raw records).
    comm.py charges each lane's EP waits in full; what the other lane's compute hid is not a wait of the step, so
    comm_ep_wait_s (metrics.jsonl) is brought here to the exposed wait, the figure it means with one lane."""
    ep_wait = sum(w[2] - w[1] for w in waits)
    exposed, overlap = exposed_ep_wait(spans, waits), lanes_overlap(spans)
    comm.COMM.record("ep", 0, exposed - ep_wait, calls=0)
    return {"ep_wait_s": ep_wait, "ep_exposed_s": exposed, "lanes_overlap_s": overlap, "ep_waits": waits}


class LaneMeans:
    """The StepLogger's lanes figures: each step's StepStats ep_exposed_s and lanes_overlap_s summed over the steps
    since the last record, handed to the record as means per step (like the step time); nothing without the lanes,
    so those fields are absent from metrics.jsonl then."""
    FIELDS = ("ep_exposed_s", "lanes_overlap_s")

    def __init__(self, on: bool):
        self.on = on
        self.sums, self.steps = dict.fromkeys(self.FIELDS, 0.0), 0

    def add(self, stats) -> None:
        """Count one step's StepStats."""
        if self.on:
            for k in self.sums:
                self.sums[k] += getattr(stats, k)
            self.steps += 1

    def take(self) -> dict:
        """The means per step since the last take ({} without the lanes), and start the next interval."""
        if not self.on:
            return {}
        means = {k: v / self.steps for k, v in self.sums.items()}
        self.sums, self.steps = dict.fromkeys(self.FIELDS, 0.0), 0
        return means
