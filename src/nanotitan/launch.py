"""Start `dp*pp*ep` local ranks through torch.distributed.run (what `torchrun --standalone` does).

`nanotitan train` with no torchrun around it calls `launch_local`, which re-executes
`python -m nanotitan.cli train ...` once per rank under torchrun's elastic agent: standalone c10d
rendezvous, output of every rank streamed with a `[rankN]:` prefix, the other ranks stopped when one
fails, and `train.max_restarts` restarts of the whole group (ranks then resume from the newest
complete checkpoint when `train.resume=auto`).
"""

from __future__ import annotations

import os
import sys


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def launch_local(nproc: int, argv: list[str], max_restarts: int = 0) -> int:
    """Run `nanotitan train <argv>` on `nproc` local ranks; returns the exit code (0 = all ranks ok)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    os.environ.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank${rank}]:")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = get_args_parser().parse_args([
        "--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
        "--tee=3", "--monitor-interval=0.5", "-m", "nanotitan.cli", "train", *argv,
    ])
    try:
        run(args)
    except ChildFailedError as e:
        failures = ", ".join(f"rank {r}: exit {f.exitcode}" for r, f in sorted(e.failures.items()))
        print(f"nanotitan: training failed ({failures}); the other ranks were stopped", file=sys.stderr)
        return 1
    return 0
