"""One machine is private (issue 49, item 1; docs/security.md): a job whose processes are all on this machine
listens on 127.0.0.1 only. torch's TCPStore binds every interface by itself, gloo the address of the hostname;
here the store gets a socket bound to loopback and the ranks GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME=lo. Checked
on the three launchers of one host: run/spawn.py (tests, benchmarks), `nanotitan train` (run/launch.py) and a
loopback elastic job (elastic/agent.py), each while it trains."""

import os
import subprocess
import sys
import time

import pytest

from tests.helpers.sockets import beyond_loopback, kill_tree, listening, rank_envs
from tests.helpers.mp import free_port, run_ranks
from tests.helpers.equivalence import base_args


def _in_rank(rank, world, parent):
    import torch.distributed as dist

    dist.barrier()  # every rank's gloo sockets are up
    out = (listening(parent), beyond_loopback(parent), os.environ.get("GLOO_SOCKET_IFNAME"),
           os.environ.get("NCCL_SOCKET_IFNAME"))
    dist.barrier()
    return out


def test_spawned_ranks_listen_on_loopback_only():
    socks, outside, gloo, nccl = run_ranks(_in_rank, 2, args=(os.getpid(),), timeout=120)[0]
    assert socks and outside == [], socks  # the store and both ranks' gloo listeners
    assert gloo == nccl == "lo"


def _one_host_job(how: str, corpus_dir, run, tmp_path) -> subprocess.Popen:
    """A 2-rank one-host job that trains until killed: `nanotitan train` (dp=2), or a one-node elastic job."""
    args = base_args(corpus_dir, run) + ["--train.steps", "100000", "--train.global_batch", "4"]
    if how == "train":
        args += ["--parallel.dp", "2", "--parallel.microbatches", "1"]
    else:
        args += ["--parallel.auto", "true", "--elastic.nodes", "1", "--elastic.nproc_per_node", "2",
                 "--elastic.endpoint", f"127.0.0.1:{free_port()}", "--elastic.id", f"loopback-{run.name}",
                 "--elastic.snapshot_dir", str(tmp_path / "shm")]
    return subprocess.Popen([sys.executable, "-m", "nanotitan.cli", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))


def _until_training(p: subprocess.Popen, run, end: float) -> None:
    """Until both ranks are in collectives (2 steps logged)."""
    metrics = run / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count('"loss"') >= 2):
        assert p.poll() is None and time.monotonic() < end, p.stdout.read() if p.poll() is not None else "timeout"
        time.sleep(0.2)


STRANGER = ("import socket, sys\n"
            "for port in map(int, sys.argv[1:]):\n"
            "    try:\n"
            "        socket.create_connection(('127.0.0.1', port), timeout=5).close(); print(port, 'open')\n"
            "    except OSError as e:\n"
            "        print(port, 'refused' if isinstance(e, ConnectionRefusedError) else type(e).__name__)\n")


def _as_another_user(ports: list[int]) -> list[str]:
    """What uid 65534 (setpriv, as root) gets connecting to each port on the host's loopback."""
    r = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", sys.executable, "-c",
                        STRANGER, *map(str, ports)], capture_output=True, text=True, timeout=120, cwd="/")
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


# It dials the job's port numbers from outside the job's network namespace: another test's listener on the same
# number there (the suite's other worker) would answer, so it runs alone (Makefile).
@pytest.mark.serial
@pytest.mark.parametrize("how", ["train", "elastic"])
def test_a_one_host_job_listens_on_loopback_only_and_no_other_user_reaches_it(how, corpus_dir, tmp_path):
    """Every socket of the job on loopback, and (as root here: setpriv) every port refused to uid 65534. A process of
    another uid connected to a one-host job's store, read its keys and wrote one (was: `num_keys 8`, `set`
    succeeded; from there torch's pickled plan exchange runs its code in the ranks): now the job runs in a network
    namespace of its own (run/netns.py)."""
    run = tmp_path / "run"
    p = _one_host_job(how, corpus_dir, run, tmp_path)
    try:
        _until_training(p, run, time.monotonic() + 240)
        socks, outside, envs = listening(p.pid), beyond_loopback(p.pid), rank_envs(p.pid)
        ports = sorted({int(a.rsplit(":", 1)[1]) for _, a in socks})
        seen = _as_another_user(ports) if os.getuid() == 0 else None
    finally:
        kill_tree(p.pid)
        p.communicate(timeout=60)
    assert len(socks) >= 3 and outside == [], socks  # the store(s), the ranks' gloo listeners (elastic: the agent's)
    if how == "train":  # an elastic rank gets its environment from its agent over a pipe: not in /proc
        assert len(envs) == 2 and all(e.get("GLOO_SOCKET_IFNAME") == e.get("NCCL_SOCKET_IFNAME") == "lo" for e in envs)
    assert seen is None or seen == [f"{port} refused" for port in ports], seen


def test_any_loopback_endpoint_is_one_host():
    """An endpoint on 127.0.0.2 (or a hostname mapped to 127.0.1.1, as Debian and Ubuntu do), or [::1], is one host
    (was: the store bound 127.0.0.1 whatever the endpoint said, and the job never started: exit 1 after 176 s). The
    store, the liveness listener and the snapshot transport listen on the endpoint's own address."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    from nanotitan.elastic.auth import single_host
    from nanotitan.elastic.liveness import Beater, LiveServer
    from nanotitan.elastic.transport import FileServer, Peer, list_units
    from nanotitan.run.loopback import join_endpoint, loopback_store, split_endpoint

    assert split_endpoint("[::1]:29500") == ("::1", 29500) and join_endpoint("::1", 1) == "[::1]:1"
    assert all(single_host(e) for e in ("127.0.0.2:1", "127.0.1.1:1", "[::1]:1", "localhost:1"))
    assert not single_host("10.1.2.3:1")
    for host in ("127.0.0.2", "::1"):
        store = loopback_store(0, 10, host=host)
        client = dist.TCPStore(host, store.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5))
        client.set("k", "v")
        assert store.get("k") == b"v"
        if host == "127.0.0.2":  # only there: not on 127.0.0.1
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", store.port), timeout=5)
        live = LiveServer(host, b"k" * 32, "job", log=lambda line: None)
        beater = Beater(live.addr, b"k" * 32, "job", 1)
        files = FileServer(host, b"k" * 32, "job")
        files.node = 1
        try:
            end = time.monotonic() + 10
            while live.state(1) != "":
                assert time.monotonic() < end, live.state(1)
                time.sleep(0.05)
            assert list_units(Peer(join_endpoint(host, files.port), "job", 1), b"k" * 32) == {}
        finally:
            beater.close()
            live.close()
            files.close()


@pytest.mark.slow
def test_a_one_host_elastic_job_at_127_0_0_2_or_ipv6_trains(corpus_dir, tmp_path):
    procs = []
    for i, host in enumerate(("127.0.0.2", "[::1]")):
        run = tmp_path / f"run{i}"
        args = base_args(corpus_dir, run) + [
            "--train.steps", "6", "--train.global_batch", "4", "--parallel.auto", "true", "--elastic.nodes", "1",
            "--elastic.endpoint", f"{host}:{free_port()}", "--elastic.id", f"lo{i}",
            "--elastic.snapshot_dir", str(tmp_path / "shm")]
        procs.append(subprocess.Popen([sys.executable, "-m", "nanotitan.cli", "train", *args], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                      env=dict(os.environ, OMP_NUM_THREADS="1")))
    outs = [p.communicate(timeout=400)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0 and "finished at step 6" in out, out
