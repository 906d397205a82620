"""Issue 49, items 2-3: an elastic job's store entries are bound to their job and launch, and a stranger's write to
node 0's store costs nothing (elastic/auth.py SignedStore, the registration in coordinator.py and agent.py).

Unit-level, on a real torch TCPStore: a stranger is anyone who reaches the store without the job's key (it can
read, copy, overwrite and delete any entry, and move the counters)."""

import json
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from nanotitan.elastic import agent as agent_mod
from nanotitan.elastic import coordinator as coord_mod
from nanotitan.run.loopback import loopback_store
from nanotitan.elastic.auth import ABSENT, ENTRY_MAX, REFUSED_MAX, SignedStore, default_id_warning, new_launch
from tests.helpers.elastic import _coordinator, _register

KEY = b"k" * 32


def _server():
    return loopback_store(timeout_s=2)  # torch's own TCPStore server would listen on every interface


def _client(raw, job="bad", launch=None, log=print):
    conn = dist.TCPStore("127.0.0.1", raw.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=2))
    return SignedStore(conn, KEY, job, launch, log=log)


# --- item 2: bound to the job and the launch -----------------------------------------------------------------

def test_an_entry_of_another_job_copied_under_this_ones_prefix_does_not_verify():
    """Two jobs with the same secret: job a's signed `done` and plan, copied byte for byte under job b's prefix,
    are refused (the MAC covers the full prefixed key); b's own entries verify."""
    raw, said = _server(), []
    launch = new_launch()
    a, b = SignedStore(raw, KEY, "a", launch, log=said.append), SignedStore(raw, KEY, "b", launch, log=said.append)
    a.set("done", json.dumps({"code": 0, "line": "finished at step 70"}))
    a.set("gen/1", json.dumps({"members": [0]}))
    for k in ("done", "gen/1"):
        b.store.set(k, a.store.get(k))
        assert b.get(k) is None and a.get(k) is not None
    assert len(said) == 2 and all("no valid MAC" in s and "another job" in s for s in said), said
    b.set("done", "x")
    assert b.get("done") == "x"
    assert b.get("absent") is None and not b.store.check(["absent"])  # a read (compare_set) creates nothing


def test_an_earlier_launchs_done_neither_ends_an_agent_nor_deletes_its_snapshots(corpus_dir, tmp_path, capsys):
    """A one-host job's secret persists in its run dir and the id may be the same: an earlier launch's signed
    `done` (code 0), written again into this launch's store, is refused in one line; the agent goes on and keeps
    its snapshots. The same entry signed with this launch's nonce ends it (and frees the snapshots)."""
    coord, store, raw = _coordinator(corpus_dir, tmp_path, "1:2")
    old = SignedStore(raw, store.key, "bad", new_launch())
    old.set("done", json.dumps({"code": 0, "line": "finished at step 70"}))
    agent = agent_mod.Agent(coord.cfg, [], store, bind="127.0.0.1")
    try:
        agent.node, agent.files.root = 0, tmp_path / "snapshots"
        (agent.files.root / "step_5").mkdir(parents=True)
        assert agent.tick() is None and agent.tick() is None
        assert (agent.files.root / "step_5").is_dir()
        out = capsys.readouterr().out
        assert out.count("refused store entry 'done': no valid MAC") == 1 and "earlier launch" in out, out
        store.set("done", json.dumps({"code": 0, "line": "finished at step 70"}))
        assert agent.tick() == 0
        agent._close()  # every ending frees the node's snapshot dir
        assert not agent.files.root.exists()
    finally:
        agent.files.close()


def test_a_joiner_learns_the_launch_and_an_earlier_launchs_request_joins_nothing(corpus_dir, tmp_path, capsys):
    """A joiner learns this launch's nonce from node 0's signed answer, bound to its own random token; its
    entries carry it. A join request of an earlier launch (signed with the same key) written again: an old one is
    ignored in one line; a fresh one gets an id but never joins, since its node never beats with this launch's
    nonce (its earlier launch's beat is refused)."""
    coord, store, raw = _coordinator(corpus_dir, tmp_path, "1:4")
    _register(coord, store, 0, coord.hash)
    _register(coord, store, 1, coord.hash)
    coord._registrations()
    assert coord.waiting == [0, 1]
    earlier = SignedStore(raw, store.key, "bad", new_launch())
    info = {"host": "old", "pid": 0, "hash": coord.hash, "files": ""}
    for i, age in enumerate((120, 1)):
        ticket = store.add("joined", 1) - 1
        earlier.set(f"join/{ticket}", json.dumps(dict(info, token=f"{i}" * 32, ts=time.time() - age)))
    coord._registrations()
    earlier.set("beat/2", str(time.time()))  # the replayed node's beat, of its launch
    for _ in range(3):
        coord._registrations()
    assert coord.waiting == [0, 1] and coord.nodes == {0, 1}, (coord.waiting, coord.nodes)
    out = capsys.readouterr().out
    assert out.count("a join request from old signed at a time 120 s behind node 0's clock") == 1, out
    assert out.count("refused store entry 'beat/2'") == 1, out


def test_a_default_job_id_is_warned_about(corpus_dir, tmp_path):
    from nanotitan.config.config import load_config
    from tests.helpers.equivalence import base_args

    def cfg(*extra):
        return load_config(None, base_args(corpus_dir, tmp_path) + ["--elastic.nodes", "1", "--parallel.auto", "true",
                                                                   "--elastic.endpoint", "127.0.0.1:1", *extra])

    line = default_id_warning(cfg())
    assert line.count("\n") == 0 and "elastic.id is the default 'nanotitan'" in line and "--elastic.id" in line
    assert default_id_warning(cfg("--elastic.id", "run-42")) == ""


# --- item 3: a stranger's write costs nothing -----------------------------------------------------------------

@pytest.mark.parametrize("garbage", [b"[" * 5000, b"{" * 100000, b"\xff" * 80, "é".encode() * 40 + b"{}",
                                     b"0" * 64 + b"\xff\xfe", b"x" * (ENTRY_MAX + 1)],
                         ids=["deep-list", "deep-dict", "not-utf8", "non-ascii-mac", "bad-value-bytes", "oversized"])
def test_a_garbage_entry_reads_as_absent_and_is_named_once(garbage):
    """Whatever a stranger writes at a key an agent polls (`done`, ten times a second) reads as absent and is
    named once, in one line: no RecursionError, no traceback, nothing parsed before the MAC verifies."""
    raw, said = _server(), []
    store = _client(raw, launch=new_launch(), log=said.append)
    store.store.set("done", garbage)
    for _ in range(5):
        assert store.get("done") is None
    assert len(said) == 1 and said[0].count("\n") == 0 and "'done'" in said[0], said
    if len(garbage) > ENTRY_MAX:
        assert f"more than {ENTRY_MAX}" in said[0]


class _Stranger:
    """The store as an agent's client sees it while a stranger acts between its calls: `check` says the key is
    there, and the stranger deletes it right after; `fail` makes every call raise as a broken store would."""

    def __init__(self, store, fail=None):
        self.store, self.fail = store, fail

    def check(self, keys):
        there = self.store.check(keys)
        self.store.delete_key(keys[0])
        return there

    def __getattr__(self, name):
        if self.fail is not None:
            raise self.fail
        return getattr(self.store, name)


def test_a_key_deleted_between_check_and_get_does_not_block():
    """A read is one non-blocking call: a key that a stranger deletes while it is read is absent at once, not a
    wait for the store's timeout (2 s here; 60 s and more in a job)."""
    raw = _server()
    store = _client(raw, launch=new_launch())
    store.set("done", "x")
    store.store = _Stranger(store.store)
    t0 = time.monotonic()
    got = store.get("done")  # a check, then a get, would wait here for a key the check saw
    assert time.monotonic() - t0 < 1.0 and got in (None, "x")


def test_a_store_error_reads_as_absent_named_once():
    raw, said = _server(), []
    store = _client(raw, launch=new_launch(), log=said.append)
    store.store = _Stranger(store.store, fail=dist.DistStoreError("Socket Timeout"))
    assert [store.get("done") for _ in range(3)] == [None] * 3
    assert len(said) == 1 and "'done' is unreadable (DistStoreError: Socket Timeout); read as absent" in said[0], said


def test_the_memory_of_refused_entries_is_bounded():
    """A stranger writing ever new garbage: each is named once, and only the REFUSED_MAX newest are remembered."""
    raw, said = _server(), []
    store = _client(raw, launch=new_launch(), log=said.append)
    for i in range(3 * REFUSED_MAX):
        store.store.set("done", f"garbage {i}")
        assert store.get("done") is None and store.get("done") is None
    assert len(said) == 3 * REFUSED_MAX and len(store.refused) == REFUSED_MAX


# --- item 3: the `joined` counter -----------------------------------------------------------------------------

def test_a_counter_moved_by_2_62_costs_node_0_nothing_and_a_joiner_still_joins(corpus_dir, tmp_path, capsys):
    """add('joined', 2**62): node 0 reads at most max_nodes tickets (named once), and the next joiner gets an id."""
    coord, store, _raw = _coordinator(corpus_dir, tmp_path, "1:4")
    _register(coord, store, 0, coord.hash)
    store.add("joined", 2**62)
    t0 = time.monotonic()
    coord._registrations()
    coord._registrations()
    assert time.monotonic() - t0 < 5.0 and len(coord.tickets) <= coord.max_nodes
    _register(coord, store, 1, coord.hash)
    coord._registrations()
    assert coord.waiting == [0, 1]
    out = capsys.readouterr().out
    assert out.count("the joined counter moved from 0 to 4611686018427387904, not by joiners") == 1, out


def test_a_counter_moved_back_hands_out_no_taken_id(corpus_dir, tmp_path):
    """add('joined', -k): node ids are node 0's own count, so the next joiner gets a new id, not a taken one."""
    coord, store, _raw = _coordinator(corpus_dir, tmp_path, "1:4")
    for node in range(3):
        _register(coord, store, node, coord.hash)
    store.add("joined", -2)
    _register(coord, store, 3, coord.hash)  # asserts the id it got is 3
    coord._registrations()
    assert coord.waiting == [0, 1, 2, 3]


def test_garbage_at_the_next_ticket_does_not_starve_a_joiner(corpus_dir, tmp_path, monkeypatch, capsys):
    """A stranger writes garbage at the next ticket's request before the joiner, and overwrites the joiner's
    request after it: the joiner asks again (REJOIN_S) and joins."""
    monkeypatch.setattr(agent_mod, "REJOIN_S", 0.5)
    monkeypatch.setattr(coord_mod, "REJOIN_S", 0.5)
    coord, store, raw = _coordinator(corpus_dir, tmp_path, "1:4")
    _register(coord, store, 0, coord.hash)
    store.store.set("join/0", b"[" * 5000)  # before: the next ticket's request
    coord._registrations()
    joiner = _client(raw)
    got = []
    asker = threading.Thread(target=lambda: got.append(agent_mod.ask_to_join(
        joiner, {"host": "h", "pid": 0, "hash": coord.hash, "files": ""}, 20, "test")))
    asker.start()
    try:
        end = time.monotonic() + 10
        while store.store.compare_set("join/0", ABSENT, ABSENT).startswith(b"["):  # until the joiner's request is there
            assert time.monotonic() < end
            time.sleep(0.01)
        store.store.set("join/0", b"garbage")  # after: over the joiner's request, before node 0 reads it
        while asker.is_alive():
            coord._registrations()
            asker.join(0.05)
    finally:
        asker.join(30)
    assert got == [1] and joiner.launch == store.launch
    joiner.set("beat/1", str(time.time()))
    coord._registrations()
    assert coord.waiting == [0, 1]
    out = capsys.readouterr().out
    assert "refused store entry 'join/0'" in out, out


def test_bye_is_signed_per_node(corpus_dir, tmp_path):
    """Node 0 keeps the store up until every agent has said bye (read `done`). `bye` was a counter anyone could move
    (a stranger's `add` let node 0 leave first, and the others lost the store before reading `done`); now each agent
    signs its own `bye/I`, and node 0 waits for those."""
    from nanotitan.elastic.agent import _wait_for_byes

    coord, store, raw = _coordinator(corpus_dir, tmp_path, "1:2")
    try:
        store.store.add("bye", 5)  # a stranger's, on the old counter
        store.store.set("bye/1", "1")  # and an unsigned entry
        t0 = time.monotonic()
        _wait_for_byes(store, {1}, timeout_s=1.0)
        assert time.monotonic() - t0 >= 1.0  # still waiting for node 1's own
        store.set("bye/1", "1")
        t0 = time.monotonic()
        _wait_for_byes(store, {1}, timeout_s=5.0)
        assert time.monotonic() - t0 < 1.0
    finally:
        coord.close()


def test_a_clock_that_is_off_is_named_on_the_joiner_and_beats_are_timed_by_node_0(corpus_dir, tmp_path, monkeypatch):
    """A joiner whose clock is 120 s behind node 0's was told its secret is wrong (node 0 ignored its request as a
    replay): node 0 now answers such a request with its time, and the joiner names the skew in one line. A node
    without a liveness connection is judged by its store beats as node 0 reads them (was: by the time written in
    them, so a clock 120 s behind was 120 s of silence)."""
    from nanotitan.config.config import ConfigError
    from nanotitan.elastic import agent as agent_mod

    coord, store, raw = _coordinator(corpus_dir, tmp_path, "1:2")
    try:
        info = {"host": "late", "pid": 0, "hash": coord.hash, "files": "127.0.0.1:1"}
        ticket = store.add("joined", 1) - 1
        store.set(f"join/{ticket}", json.dumps(dict(info, token="a" * 32, ts=time.time() - 120)))
        coord._registrations()
        assert abs(json.loads(store.get(f"assign/{'a' * 32}"))["clock"] - time.time()) < 5
        store.set(f"assign/{'b' * 32}", json.dumps({"clock": time.time() + 120}))  # node 0's answer to this joiner
        with monkeypatch.context() as m, pytest.raises(
                ConfigError, match=r"^this node's clock is 120 s behind node 0's, more than the 60 s the job's signed "
                                   r"requests allow: synchronise the clocks"):
            m.setattr(agent_mod.secrets, "token_hex", lambda n: "b" * 32)
            agent_mod.ask_to_join(store, info, 10, "127.0.0.1:9")

        _register(coord, store, 0, coord.hash)
        _register(coord, store, 1, coord.hash)
        store.set("beat/1", str(time.time() - 120))  # node 1's clock, 120 s behind
        assert coord._lost(1) == ""
        monkeypatch.setattr(coord_mod, "LOST_S", 0.5)
        time.sleep(0.3)
        store.set("beat/1", str(time.time() - 119))  # its next beat: it lives
        assert coord._lost(1) == ""
        time.sleep(0.7)  # no beat since: silent past LOST_S, as node 0 counts it
        assert coord._lost(1).startswith("node 1's agent stopped answering (no beat for")
    finally:
        coord.close()
