"""The config rules of a step that never waits on the host: the EP dispatch's shapes (parallel.ep_dispatch,
parallel.ep_capacity: parallel/ep.py, docs/ep.md "A step that never waits on the host") and CUDA graphs
(train.cuda_graphs: parallel/compile.py, docs/compile.md). A leaf like config.py, which calls them from `validate`."""

from __future__ import annotations

from .errors import check as _check
from .layout import expert_ranks


def check_dispatch(cfg) -> None:
    """Static dispatch keeps every size on the device: refuse what would read one to the host."""
    m, p = cfg.model, cfg.parallel
    _check(p.ep_dispatch in ("dynamic", "static"),
           f"parallel.ep_dispatch={p.ep_dispatch!r} must be dynamic or static (--parallel.ep_dispatch)")
    _check(p.ep_capacity >= 1, f"parallel.ep_capacity={p.ep_capacity} must be >= 1: each peer's buffer holds that many "
                               f"times its expected share, and below 1 even a balanced router overflows "
                               f"(--parallel.ep_capacity 1.25)")
    if p.ep_dispatch == "dynamic":
        return
    why = "parallel.ep_dispatch=static keeps every split size on the device"
    _check(p.auto or expert_ranks(p.ep, p.cp, p.tp) > 1,
           f"{why}, and parallel.ep*cp*tp=1 dispatches nothing (--parallel.ep 2, or --parallel.ep_dispatch dynamic)")
    _check(m.experts_impl == "grouped",
           f"{why}, and model.experts_impl={m.experts_impl} may run one GEMM per expert, sized by counts read to the "
           f"host (--model.experts_impl grouped, or --parallel.ep_dispatch dynamic)")
    _check(not p.ep_overlap, f"{why}, and parallel.ep_overlap cuts each trip into groups by host counts "
                             f"(--parallel.ep_overlap false, or --parallel.ep_dispatch dynamic)")


def check_graphs(cfg) -> None:
    """CUDA graphs are recorded on a CUDA stream, from compiled blocks."""
    t = cfg.train
    if not t.cuda_graphs:
        return
    _check(t.device != "cpu", "train.cuda_graphs=true records CUDA graphs, and train.device=cpu has no CUDA stream "
                              "(--train.cuda_graphs false, or --train.device cuda)")
    _check(t.compile, "train.cuda_graphs=true replays the compiled blocks' graphs (torch.compile mode "
                      "reduce-overhead), and train.compile=false compiles none (--train.compile true)")
