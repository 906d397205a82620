"""`nanotitan` entry point: train, data prepare, generate, bench, plan.

    nanotitan train [--config FILE] [--section.key VALUE ...]
    nanotitan data prepare [--config FILE] [--data.source ...]
    nanotitan generate --run.dir DIR [--prompt TEXT] [--tokens N]
    nanotitan bench {dp,pp,ep,layouts} [...]
    nanotitan plan --config FILE --gpus N [...]
"""

from __future__ import annotations

import sys

from .config import ConfigError, load_config

USAGE = __doc__


def _split_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """Pull `--config FILE` out of the override list."""
    path, rest, i = None, [], 0
    while i < len(argv):
        if argv[i] == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a path (--config configs/default.toml)")
            path, i = argv[i + 1], i + 2
        elif argv[i].startswith("--config="):
            path, i = argv[i].split("=", 1)[1], i + 1
        else:
            rest.append(argv[i])
            i += 1
    return path, rest


def cmd_train(argv: list[str]) -> int:
    from .launch import launch_local, under_torchrun

    path, overrides = _split_config(argv)
    cfg = load_config(path, overrides)
    if cfg.parallel.auto:
        # The planner picks the layout for this world at the same global batch; under an elastic torchrun
        # restart with a new world size it re-plans, and resume reshards the checkpoint onto the new layout.
        import os

        from .plan import PlanOptions, recommend

        world = int(os.environ.get("WORLD_SIZE", 0)) or cfg.parallel.world or cfg.world_size
        B = cfg.train.global_batch or cfg.global_batch
        # m stays as configured: the balance loss is per microbatch, so only the same (B, m) trains the same model.
        dp, pp, ep, schedule, M, m = recommend(cfg, world, None,
                                               PlanOptions(global_batch=B, micro_batch=cfg.train.micro_batch))
        overrides = overrides + ["--parallel.dp", str(dp), "--parallel.pp", str(pp), "--parallel.ep", str(ep),
                                 "--parallel.schedule", schedule, "--parallel.microbatches", str(M),
                                 "--train.micro_batch", str(m), "--train.global_batch", str(B),
                                 "--parallel.auto", "false"]
        cfg = load_config(path, overrides)
        print(f"planner: world {world}, global batch {B}: dp={dp} pp={pp} ep={ep} {schedule} M={M} m={m}",
              flush=True)
        argv = ([f"--config={path}"] if path else []) + overrides

    if under_torchrun():
        from .train import run

        _die_with_parent()

        run(cfg)
        return 0
    if cfg.world_size > 1:
        # Prepare the data once here so the ranks find it cached.
        from .data.prepare import prepare_data

        prepare_data(cfg.data)
        if cfg.train.device != "cuda" and not cfg.train.peak_flops:
            import os

            from .metrics import cpu_peak_flops

            threads = cfg.train.threads or max(1, (os.cpu_count() or 1) // cfg.world_size)
            os.environ["NANOTITAN_CPU_PEAK_FLOPS"] = str(cpu_peak_flops(threads))  # measured before ranks start
        code = launch_local(cfg.world_size, argv, cfg.train.max_restarts)
    else:
        from .train import run

        run(cfg)
        code = 0
    if code == 0 and cfg.train.sample_tokens > 0:
        from .generate import generate_from_run

        try:
            text = generate_from_run(cfg.run.dir, "\n", cfg.train.sample_tokens)
            print("\n--- sample from the trained model ---\n" + text.strip() + "\n-------------------------------------")
        except ConfigError as e:
            print(f"(no sample: {e})")
    return code


def _die_with_parent() -> None:
    """A rank must not outlive its torchrun agent (killed agent -> orphans training forever): ask Linux for
    SIGKILL when the parent dies."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def cmd_data(argv: list[str]) -> int:
    if not argv or argv[0] != "prepare":
        raise ConfigError("usage: nanotitan data prepare [--config FILE] [--data.source SRC] [--data.vocab_size N]")
    from .data.prepare import load_meta, prepare_data

    path, overrides = _split_config(argv[1:])
    cfg = load_config(path, overrides)
    out = prepare_data(cfg.data)
    meta = load_meta(out)
    print(f"prepared {out}: {meta}")
    return 0


def cmd_generate(argv: list[str]) -> int:
    import argparse

    from .generate import generate_from_run

    ap = argparse.ArgumentParser(prog="nanotitan generate")
    ap.add_argument("--run.dir", dest="run_dir", required=True)
    ap.add_argument("--prompt", default="\n")
    ap.add_argument("--tokens", type=int, default=200)
    args = ap.parse_args(argv)
    print(generate_from_run(args.run_dir, args.prompt, args.tokens))
    return 0


def cmd_bench(argv: list[str]) -> int:
    if not argv:
        raise ConfigError("usage: nanotitan bench {dp,pp,ep,layouts} [...]")
    what, rest = argv[0], argv[1:]
    if what == "layouts":
        from .bench_layouts import main as layouts_main

        return layouts_main(rest)
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / f"bench_{what}.py"
    if not script.exists():
        raise ConfigError(f"no benchmark {what!r} (choose dp, pp, ep or layouts; run from a source checkout)")
    sys.argv = [str(script), *rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def cmd_plan(argv: list[str]) -> int:
    from .plan import main as plan_main

    return plan_main(argv)


COMMANDS = {"train": cmd_train, "data": cmd_data, "generate": cmd_generate, "bench": cmd_bench, "plan": cmd_plan}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(USAGE)
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except ConfigError as e:
        print(f"nanotitan: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
