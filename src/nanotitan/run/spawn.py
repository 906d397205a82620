"""Run a function on N local processes joined by one gloo process group, and collect what each returns.

    results = run_ranks(fn, world=4, args=(cfg,), timeout=120)   # [fn(0, 4, cfg), ..., fn(3, 4, cfg)]

Each rank is a fresh `spawn`ed process (or, with start_method="forkserver", forked from a server that
imported torch once: the test suite's choice, tests/helpers/mp.py) that takes the caller's environment and working
directory as they are now, sets `torch.set_num_threads(threads)`, the torchrun-style environment (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT) plus `env`, joins
`init_process_group("gloo", timeout=pg_timeout)` (backend="nccl": rank r on GPU r) and calls
`fn(rank, world, *args)`. `fn` and `args` must be picklable (a module-level function); so must the results, which
come back by value. Used by the multi-rank tests (tests/helpers/mp.py), the benchmarks (`nanotitan bench`),
`nanotitan plan --measure` and `nanotitan verify`.

Rendezvous: THIS process hosts the TCPStore, bound to 127.0.0.1 port 0 so the kernel picks a free port at bind
time and the children connect to it; gloo and NCCL bind the loopback interface too (run/loopback.py). Picking a "free"
port first and binding it later (the old copies) races with every other job on the machine (two test files at once, a
benchmark beside the tests); the store holding its port from the start cannot collide. gloo's own connections also bind
port 0. Hosting the store in the parent (as torchrun's agent does) also means it outlives any rank that dies.

Failure: the first rank that raises ends the run: every rank is killed first, then joined, and the
RuntimeError carries that rank's traceback. A rank that dies without reporting (os._exit, a signal)
fails the run the same way. Past `timeout` (counted from the start, process start-up included) every
rank is killed and TimeoutError carries the Python stack of each rank still running. Ranks also exit
on their own if this process dies, so nothing outlives the caller.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import pickle
import queue
import signal
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing import forkserver
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .allocator import keep_freed_memory
from .loopback import HOST, loopback_env, loopback_store


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, someone else's
        pass
    return True


def _exit_with_parent(parent_pid: int) -> None:
    """Daemon thread: end this rank if the process that started it is gone (killed, crashed), instead
    of leaving it blocked in a collective until the process-group timeout. A forkserver's child has the
    forkserver as parent (it exits with the caller): a new parent or a caller gone, either ends the rank."""
    ppid = os.getppid()

    def watch():
        while os.getppid() == ppid and _alive(parent_pid):
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def _worker(rank, world, port, fn, args, q, pg_timeout, threads, env, stack_dir, parent_pid, caller, backend="gloo"):
    _exit_with_parent(parent_pid)
    caller_env, caller_cwd = caller  # the caller's as they are now (a forkserver's child starts with the server's)
    os.environ.clear()
    os.environ.update(caller_env)
    os.chdir(caller_cwd)
    if hasattr(signal, "SIGUSR1"):  # at a timeout the parent sends it: every thread's stack to a file it reads
        stack_file = open(Path(stack_dir) / f"rank{rank}.txt", "w")
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.update(MASTER_ADDR=HOST, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), **loopback_env())  # gloo/NCCL on loopback
    os.environ.update(env or {})
    keep_freed_memory()
    torch.set_num_threads(threads)
    try:
        timeout = timedelta(seconds=pg_timeout)
        store = dist.TCPStore(HOST, port, world, is_master=False, timeout=timeout)
        device = None
        if backend == "nccl":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, device_id=device)
        out = fn(rank, world, *args)
        # Plain pickle: tensors travel by value, not as shared-memory handles that die with this process.
        q.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - everything goes to the parent, which decides
        q.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _stacks(procs, stack_dir: str) -> str:
    """Ask every live rank for its Python stacks (faulthandler on SIGUSR1) and return them."""
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    if not hasattr(signal, "SIGUSR1"):
        return "(stacks need SIGUSR1)"
    for r in alive:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(0.5)  # faulthandler writes from the signal handler: immediate, even in a blocked C call
    parts = []
    for r in alive:
        f = Path(stack_dir) / f"rank{r}.txt"
        text = f.read_text().strip() if f.exists() else ""
        parts.append(f"--- rank {r} ---\n{text or '(no stack written)'}")
    return "\n".join(parts)


def start_forkserver(preload: list[str]) -> None:
    """Start the server start_method="forkserver" forks ranks from (if not running), with `preload` imported once
    there and this process's sys.path: Python 3.11's forkserver drops the one it is handed, and without it neither
    the preloads nor the ranks' functions would import."""
    mp.set_forkserver_preload(preload)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def run_ranks(fn, world: int, args: tuple = (), timeout: float = 120.0, pg_timeout: float = 60.0, threads: int = 1,
              env: dict | None = None, start_method: str = "spawn", backend: str = "gloo") -> list:
    """fn(rank, world, *args) on `world` gloo ranks (or NCCL's, a GPU each); their results in rank order. Raises
    RuntimeError (with the failing rank's traceback) if a rank fails or dies, TimeoutError (with the
    live ranks' stacks) after `timeout` seconds; either way every rank has been killed and joined.
    start_method "forkserver" forks each rank from one server process that imported its preload modules
    once (mp.set_forkserver_preload): the test suite's ranks start without re-importing torch."""
    if world < 1:
        raise ValueError(f"run_ranks needs world >= 1, got {world}")
    ctx = mp.get_context(start_method)
    q = ctx.Queue()
    name = f"run_ranks({getattr(fn, '__name__', fn)}, world={world})"
    store = loopback_store(0, pg_timeout)  # 127.0.0.1 only: torch's own bind is every interface
    results: dict[int, object] = {}
    failure: BaseException | None = None
    with tempfile.TemporaryDirectory(prefix="nanotitan-ranks-") as stack_dir:
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(r, world, store.port, fn, args, q, pg_timeout, threads, env, stack_dir,
                                   os.getpid(), (dict(os.environ), os.getcwd()), backend))
                 for r in range(world)]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout
            while len(results) < world and failure is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    pending = [r for r in range(world) if r not in results]
                    failure = TimeoutError(f"{name}: ranks {pending} still running "
                                           f"after {timeout:g} s; their stacks:\n{_stacks(procs, stack_dir)}")
                    break
                try:
                    rank, ok, payload = q.get(timeout=min(left, 0.5))
                except queue.Empty:
                    gone = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results]
                    if not gone:
                        continue
                    try:  # a rank that reported and then exited has its message in the pipe already
                        rank, ok, payload = q.get(timeout=1.0)
                    except queue.Empty:
                        failure = RuntimeError(f"{name}: rank {gone[0]} died "
                                               f"(exit code {procs[gone[0]].exitcode}) without reporting")
                        break
                if ok:
                    results[rank] = pickle.loads(payload)
                else:  # a peer that died first is the likelier cause of, e.g., a gloo "connection closed"
                    dead = [f"rank {r} (exit code {p.exitcode})" for r, p in enumerate(procs)
                            if p.exitcode not in (None, 0) and r != rank]
                    note = f" (already dead without reporting: {', '.join(dead)})" if dead else ""
                    failure = RuntimeError(f"{name}: rank {rank} failed{note}:\n{payload}")
        except BaseException as e:  # KeyboardInterrupt, a result that does not unpickle: still clean up
            failure = e
        finally:
            if failure is not None:  # kill every rank first: a rank left alive would block a join
                for p in procs:
                    if p.pid is not None and p.exitcode is None:
                        p.kill()
            end = time.monotonic() + 10.0  # clean exits only tear down their process group
            for p in procs:
                if p.pid is None:
                    continue
                p.join(timeout=max(0.0, end - time.monotonic()))
                if p.exitcode is None:
                    p.kill()
                    p.join()
            q.close()
            del store
    if failure is not None:
        raise failure
    return [results[r] for r in range(world)]
