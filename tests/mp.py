"""Run a function on N real processes over gloo, with a hard timeout, and collect what each rank returns.

Used by every multi-rank test: `results = run_ranks(fn, world=4, args=(...,))` calls
`fn(rank, world, *args)` in each process after `init_process_group("gloo")` (with a process-group
timeout), and returns the per-rank return values (picklable). A rank that raises fails the test with
its traceback; a run past `timeout` kills every rank and fails instead of hanging.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, q, pg_timeout):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout))
        out = fn(rank, world, *args)
        # Plain pickle: tensors travel by value, not as shared-memory handles that die with this process.
        q.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, "err", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, args: tuple = (), timeout: float = 120.0, pg_timeout: float = 60.0) -> list:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, q, pg_timeout), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        import time
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"ranks timed out after {timeout}s; finished: {sorted(results)}")
            try:
                rank, status, out = q.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and len(results) + len(errors) < world:
                    # give the queue a moment: a rank may have reported before exiting
                    try:
                        rank, status, out = q.get(timeout=2.0)
                    except queue.Empty:
                        raise RuntimeError(f"rank(s) {dead} died without reporting") from None
                else:
                    continue
            if status == "ok":
                results[rank] = pickle.loads(out)
            else:
                errors.append(f"--- rank {rank} ---\n{out}")
                break  # one failure: stop everyone
        if errors:
            raise RuntimeError("a rank failed:\n" + "\n".join(errors))
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world)]
