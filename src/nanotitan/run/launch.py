"""Start this node's ranks through torch.distributed.run (torchrun's elastic agent), on one node or many.

`nanotitan train` with no torchrun around it calls `launch_local`, which re-executes
`python -m nanotitan.cli train ...` once per rank under torchrun's agent: output of every rank streamed
with a `[rankN]:` prefix, the other ranks stopped when one fails, and `train.max_restarts` restarts of the
whole group (ranks then resume from the newest complete checkpoint when `train.resume=auto`).

- One machine: a standalone c10d rendezvous, `dp*pp*ep` ranks (what `torchrun --standalone` does), its store
  and the ranks' gloo/NCCL sockets on 127.0.0.1 only (run/loopback.py; --standalone's store binds every interface).
- Slurm: under `srun --ntasks-per-node 1` (one task per node, no torchrun), each task is its node's agent.
  `slurm_rendezvous` reads Slurm's variables and points every node at the same c10d rendezvous: the first
  node of the step's node list as endpoint, port MASTER_PORT (or one derived from the job id, the same on
  every node), the job id as rendezvous id. So `srun --nodes 2 --ntasks-per-node 1 nanotitan train ...` is the
  whole recipe (examples/slurm.sbatch).

Failures and stops (docs/reliability.md): the console shows rank output on stdout; each rank's full output
(stderr, tracebacks) goes to RUN_DIR/logs/rank_N.log (`start_rank`). When ranks fail the launcher prints ONE
line: a stall named by rank and axis from the ranks' comm records (`parallel/comm/stall.py`), else the first
failing rank's error (`rank_failed` hands it over in torchrun's error file). SIGINT stops every rank at
once (exit 130); SIGTERM with train.ckpt_on_signal lets every rank finish its step and save (exit 143); the
line names the newest complete checkpoint and how to resume.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import signal
import sys
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

from ..config.config import ConfigError
from .loopback import HOST, loopback_env, loopback_store


def under_torchrun(env=os.environ) -> bool:
    return "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env)


@dataclass(frozen=True)
class Rendezvous:
    """Where this node's agent meets the others: `nnodes` agents of `nproc_per_node` ranks each."""
    nnodes: int
    node_rank: int  # this node's index in the node list (node 0 hosts the rendezvous store)
    nproc_per_node: int
    endpoint: str  # host:port of the c10d rendezvous
    run_id: str

    def torchrun_args(self) -> list[str]:
        return [f"--nnodes={self.nnodes}", f"--nproc-per-node={self.nproc_per_node}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.run_id}",
                # the host is node 0 by rank, not by matching its hostname against the endpoint's
                f"--rdzv-conf=is_host={1 if self.node_rank == 0 else 0}"]


def expand_nodelist(spec: str) -> list[str]:
    """Slurm's compressed host list -> host names, in order.

    "node[01-03],gpu7" -> node01 node02 node03 gpu7; "rack[1-2]-n[1,3]" -> rack1-n1 rack1-n3 rack2-n1 rack2-n3
    (zero padding kept: [08-10] -> 08 09 10).
    """
    hosts = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", spec):  # split on commas outside brackets
        parts = re.split(r"\[([^\]]*)\]", item)  # text, ranges, text, ranges, ..., text
        choices = []
        for i, part in enumerate(parts):
            if i % 2 == 0:
                choices.append([part])
                continue
            values = []
            for rng in part.split(","):
                lo, _, hi = rng.partition("-")
                if not lo.isdigit() or (hi and not hi.isdigit()):
                    raise ConfigError(f"cannot read the Slurm node list {spec!r} (bad range {rng!r})")
                width = len(lo) if lo.startswith("0") else 0
                values += [str(n).zfill(width) for n in range(int(lo), int(hi or lo) + 1)]
            choices.append(values)
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    return hosts


def slurm_rendezvous(world_size: int, env=os.environ) -> Rendezvous | None:
    """The rendezvous for this node when running as an `srun` task without torchrun, else None.

    One task per node: each starts world_size / nodes ranks. A multi-node allocation outside srun (the batch
    script itself, an salloc shell) is refused: the other nodes would never join."""
    nnodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    if "SLURM_JOB_ID" not in env or under_torchrun(env):
        return None
    if "SLURM_STEP_ID" not in env:  # srun sets it; the batch script and salloc shells do not
        if nnodes > 1:
            raise ConfigError(f"SLURM_NNODES={nnodes} but not inside srun: start the job with "
                              "`srun --ntasks-per-node 1 nanotitan train ...` (see examples/slurm.sbatch)")
        return None
    ntasks = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or nnodes)
    per_node = env.get("SLURM_NTASKS_PER_NODE", "1")
    if ntasks != nnodes or per_node != "1":
        raise ConfigError(f"srun started {ntasks} tasks on {nnodes} nodes (SLURM_NTASKS_PER_NODE={per_node}): "
                          "use `srun --ntasks-per-node 1`, nanotitan starts each node's ranks itself")
    if nnodes == 1:
        return None  # one node: the standalone launch
    if world_size % nnodes:
        raise ConfigError(f"parallel.dp*pp*ep*tp*cp = {world_size} ranks do not split evenly over {nnodes} Slurm nodes "
                          f"(choose a layout whose product is a multiple of {nnodes}, or srun --nodes N)")
    nproc = world_size // nnodes
    gpus = env.get("SLURM_GPUS_ON_NODE")
    if gpus and gpus.isdigit() and 0 < int(gpus) < nproc:
        raise ConfigError(f"{nproc} ranks per node but SLURM_GPUS_ON_NODE={gpus} (request --gpus-per-node {nproc}, "
                          f"or a layout of {int(gpus) * nnodes} ranks)")
    nodes = expand_nodelist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                            or env.get("SLURM_NODELIST", ""))
    if len(nodes) != nnodes:
        raise ConfigError(f"Slurm node list {nodes} does not have SLURM_NNODES={nnodes} nodes")
    job = env["SLURM_JOB_ID"]
    # The same port on every node without talking: MASTER_PORT, or one derived from the job id.
    port = int(env.get("MASTER_PORT") or 20000 + (int(job) if job.isdigit() else zlib.crc32(job.encode())) % 20000)
    return Rendezvous(nnodes=nnodes, node_rank=int(env.get("SLURM_NODEID", 0)), nproc_per_node=nproc,
                      endpoint=f"{nodes[0]}:{port}", run_id=f"nanotitan-{job}-{env['SLURM_STEP_ID']}")


LOG_ENV = "NANOTITAN_LOG_DIR"  # set by the launcher for its ranks: where rank_N.log and the comm records go
SHUTDOWN_S = 1  # after a failure or SIGINT, ranks still alive this long are killed (a SIGSTOPped one never exits)


def launch_local(nproc: int, argv: list[str], max_restarts: int = 0, rdzv: Rendezvous | None = None,
                 run_dir: str = "run", ckpt_on_signal: bool = False, command: str = "train") -> int:
    """Run `nanotitan <command> <argv>` (train, or eval) on `nproc` ranks of this machine (standalone), or as one
    node of `rdzv`; returns the exit code (0 = all ranks ok, 130/143 = stopped by SIGINT/SIGTERM) after printing
    one line for a failure or a stop."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    os.environ.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank${rank}]:")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    log_dir = (Path(run_dir) / "logs").absolute()
    log_dir.mkdir(parents=True, exist_ok=True)
    for old in [*log_dir.glob("comm_rank_*.ring"), *log_dir.glob("stall_rank_*.json")]:  # an earlier job's
        old.unlink(missing_ok=True)
    os.environ[LOG_ENV] = str(log_dir)
    world = nproc * (rdzv.nnodes if rdzv else 1)
    store = None
    if rdzv is None:  # one machine: what --standalone does, with its store and the ranks' sockets on loopback
        store = loopback_store(0, multi_tenant=True)  # torchrun's c10d rendezvous shares this server
        os.environ.update(loopback_env())
        rdzv = Rendezvous(nnodes=1, node_rank=0, nproc_per_node=nproc, endpoint=f"{HOST}:{store.port}",
                          run_id=f"nanotitan-{uuid.uuid4().hex[:12]}")
        _loopback_worker_store()
    where = rdzv.torchrun_args() + (["--local-addr", HOST] if store is not None else [])
    # torchrun's agent turns SIGINT (and SIGTERM) into SignalException: it passes the signal to the ranks and
    # kills what is left after SHUTDOWN_S. With ckpt_on_signal, SIGTERM is ours: forwarded to the ranks, which
    # finish their step, save and exit 0 while the agent keeps watching them.
    signals = "SIGINT,SIGHUP,SIGQUIT" + ("" if ckpt_on_signal else ",SIGTERM")
    args = get_args_parser().parse_args([
        *where, f"--max-restarts={max_restarts}", "--tee=1", "--monitor-interval=0.5",
        f"--signals-to-handle={signals}", f"--shutdown-timeout={SHUTDOWN_S}",
        "-m", "nanotitan.cli", command, *argv,
    ])
    _quiet_agent()
    got: list[int] = []
    if ckpt_on_signal:
        def on_sigterm(signum, frame):
            got.append(signum)
            _signal_ranks(signum)
        old_handler = signal.signal(signal.SIGTERM, on_sigterm)
    started = time.time()
    try:
        run(args)
    except SignalException as e:
        print(f"nanotitan: {stop_line(e.sigval, run_dir, argv)}", file=sys.stderr)
        return 128 + e.sigval
    except KeyboardInterrupt:  # before the agent took over SIGINT
        print(f"nanotitan: {stop_line(signal.SIGINT, run_dir, argv)}", file=sys.stderr)
        return 130
    except ChildFailedError as e:
        line, code = failure_line(e, log_dir, world, started)
        if got:
            line = f"{stop_line(got[0], run_dir, argv, saved=False)}; while stopping: {line}"
            code = 128 + got[0]
        print(f"nanotitan: {line}", file=sys.stderr)
        return code
    finally:
        if ckpt_on_signal:
            signal.signal(signal.SIGTERM, old_handler)
    if got:
        print(f"nanotitan: {stop_line(got[0], run_dir, argv, saved=True)}", file=sys.stderr)
        return 128 + got[0]
    return 0


def _quiet_agent() -> None:
    """The agent's own log lines ("Sending process N closing signal", "failed (exitcode: 1)") would bury the
    one line we print (LOGLEVEL=INFO brings them back). And torch 2.13's agent stops the ranks left after a
    failure with a fixed 30 s grace (`SubprocessContext._poll` calls `close()` with its default), not
    --shutdown-timeout: a SIGSTOPped rank, which cannot act on SIGTERM, would hold the job that long."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import PContext

    if "LOGLEVEL" not in os.environ:
        for name in list(logging.root.manager.loggerDict):
            if name.startswith("torch.distributed.elastic"):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    close = PContext.close
    if not getattr(close, "grace_capped", False):
        def close_soon(self, death_sig=None, timeout: int = SHUTDOWN_S) -> None:
            close(self, death_sig, min(timeout, SHUTDOWN_S))
        close_soon.grace_capped = True
        PContext.close = close_soon


def _loopback_worker_store() -> None:
    """torch 2.13's c10d rendezvous hosts a second store for the ranks (the one their process group meets at),
    TCPStore(its node's address, 0), which binds every interface. For a node whose address is loopback (a
    one-machine launch: --local-addr 127.0.0.1), that store is bound to 127.0.0.1 only (run/loopback.py)."""
    import ipaddress

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    create = DynamicRendezvousHandler._create_tcp_store_server
    if getattr(create, "loopback", False):
        return

    def create_here(self, master_addr, master_port):
        try:
            local = ipaddress.ip_address(master_addr).is_loopback
        except ValueError:  # a host name: torch's own store
            local = False
        return loopback_store(master_port, multi_tenant=True, host=master_addr) if local \
            else create(self, master_addr, master_port)
    create_here.loopback = True
    DynamicRendezvousHandler._create_tcp_store_server = create_here


def _signal_ranks(signum: int) -> None:
    """Pass a signal to this process's child processes (torchrun starts each rank in a session of its own,
    so a terminal's or a scheduler's signal to us does not reach them)."""
    me = os.getpid()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == me:
                os.kill(int(stat.parent.name), signum)
        except (OSError, ValueError, IndexError):
            pass  # gone meanwhile


def stop_line(signum: int, run_dir: str, argv: list[str], saved: bool = False) -> str:
    """The line for a job stopped by a signal: which, the newest complete checkpoint, how to resume."""
    from ..state.manifest import latest_checkpoint

    name = signal.Signals(signum).name
    ck = latest_checkpoint(run_dir)
    what = f"stopped by {name}" if signum == signal.SIGTERM else f"interrupted ({name})"
    if ck is None:
        return f"{what}; no complete checkpoint in {run_dir} yet (a new run starts from step 0)"
    rest = [a for a in argv if not a.startswith("--train.resume")]
    if "--train.resume" in argv:  # drop its value too
        i = argv.index("--train.resume")
        rest = argv[:i] + argv[i + 2:]
    how = shlex.join(["nanotitan", "train", *rest, "--train.resume", "auto"])
    return f"{what}; {'saved' if saved else 'newest complete checkpoint'} {ck}; resume with: {how}"


def failure_line(e, log_dir: Path, world: int, started: float) -> tuple[str, int]:
    """(one line, exit code) for ranks that failed: a stall named from the comm records, else the error of
    the rank that failed first (a rank killed by a signal first: its peers' errors follow from its death)."""
    from ..config.errors import EXIT_CODES
    from ..parallel.comm.stall import diagnose

    stalled = diagnose(log_dir, world, since=started)
    if stalled:
        return f"{stalled} (see {log_dir}/rank_N.log)", 1

    def order(item):
        rank, f = item
        reported = f.error_file_data.get("time") if isinstance(f.error_file_data, dict) else None
        return (reported is not None, reported or f.timestamp, rank)

    rank, f = min(e.failures.items(), key=order)
    data = f.error_file_data if isinstance(f.error_file_data, dict) else {}
    if "time" not in data:  # no line from the rank: it died without reporting
        how = f"was killed by {f.signal_name()}" if f.exitcode < 0 else f"exited with code {f.exitcode}"
        return f"training failed: rank {rank} {how}; the other ranks were stopped (log: {log_dir}/rank_{rank}.log)", 1
    if data.get("kind") in EXIT_CODES:  # one line every rank agreed on: no rank, no log needed
        return f.message, EXIT_CODES[data["kind"]]
    return f"training failed on rank {rank}: {f.message} (log: {log_dir}/rank_{rank}.log)", 1


# --- inside a rank -----------------------------------------------------------------------------------

class _Tee:
    """sys.stdout of a rank: the console (through torchrun's prefixing tail) and the rank's log."""

    def __init__(self, stream, log):
        self._stream, self._log = stream, log

    def write(self, text):
        self._log.write(text)
        return self._stream.write(text)

    def flush(self):
        self._log.flush()
        self._stream.flush()

    def __getattr__(self, name):  # isatty, fileno, encoding, ... of the console stream
        return getattr(self._stream, name)


def start_rank(run_dir: str, timeout_s: float) -> None:
    """In a rank under torchrun: back the stall record by RUN_DIR/logs/comm_rank_N.ring and, when our launcher
    started this rank, send its output to RUN_DIR/logs/rank_N.log (stderr only there, stdout also to the console)."""
    import faulthandler

    from ..parallel.comm.stall import RECORD

    from ..config.errors import StorageError, os_reason

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    log_dir = Path(os.environ.get(LOG_ENV) or Path(run_dir) / "logs")
    try:  # a full disk here is one line (fail_rank), not a traceback on the launcher's console
        RECORD.open(log_dir, rank, world, timeout_s)
        if not os.environ.get(LOG_ENV):  # an outside torchrun owns the output
            return
        log = open(log_dir / f"rank_{rank}.log", "a", buffering=1)  # noqa: SIM115 - open for the rank's life
    except OSError as e:
        raise StorageError(f"cannot write the rank's logs in {log_dir}: {os_reason(e)}") from None
    log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} rank {rank}/{world} pid {os.getpid()} attempt "
              f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}: {shlex.join(sys.argv)}\n")
    sys.stderr.flush()
    os.dup2(log.fileno(), 2)  # everything on stderr, C++ included
    sys.stdout = _Tee(sys.stdout, log)
    faulthandler.enable()  # a crash in C leaves its Python stack in the log
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack, into the log


def fail_rank(e: BaseException) -> None:
    """In a rank that is failing: hand its one line to the launcher (torchrun's error file), write it (or the
    traceback) to stderr, and exit at once. A failed rank has nothing left to flush (metrics are written
    line by line, checkpoints are atomic), while the interpreter's teardown (a full GC of a heap holding
    torch, datasets, ...) took 10+ s on a loaded machine, all of it before the launcher can act."""
    import traceback

    from ..config.errors import EXIT_CODES, LABELS, CheckpointError, StorageError, TrainingError, first_line

    if isinstance(e, SystemExit):
        raise e
    if isinstance(e, ConfigError):
        kind, line, code = "config", f"config error: {e}", 2
    elif isinstance(e, (TrainingError, CheckpointError, StorageError)):
        kind, line, code = e.kind, f"{LABELS[e.kind]}{e}", EXIT_CODES[e.kind]
    elif isinstance(e, KeyboardInterrupt):
        kind, line, code = "error", "interrupted (SIGINT)", 130
    else:
        kind, line, code = "error", first_line(e), 1
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            with open(path, "w") as f:
                json.dump({"message": line, "timestamp": int(time.time()), "time": time.time(), "kind": kind}, f)
        except OSError:
            pass
    if kind == "error" and code == 1:
        traceback.print_exception(e)
    print(f"nanotitan: rank {os.environ.get('RANK', '?')}: {line}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
