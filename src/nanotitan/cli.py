"""`nanotitan` entry point: train, data prepare, generate, export, eval, bench, plan, plot, verify.

    nanotitan train [--config FILE] [--section.key VALUE ...]
    nanotitan data prepare [--config FILE] [--data.source ...]
    nanotitan generate (--run.dir DIR | --init.from_hf HF_DIR) [--prompt TEXT] [--max-new-tokens N] [--greedy]
                       [--temperature T] [--top-k K] [--top-p P] [--seed S] [--format text|sft]
    nanotitan export --run.dir DIR [--step N] --out HF_DIR [--dtype fp32|bf16] [--force]
    nanotitan eval --run.dir DIR [--step N] [--data.source SRC] [--parallel.dp N ...]
    nanotitan bench NAME [...]
    nanotitan plan --config FILE --ranks N [...]
    nanotitan plot RUN_DIR [RUN_DIR ...] [--out DIR]
    nanotitan verify [--layout dp=2,pp=2,ep=2] [--steps N] [--json PATH] [--config FILE] [--section.key VALUE ...]
    nanotitan verify --fuzz N [--seed S] [--log PATH] [--chunk K] [--section.key VALUE ...]
    nanotitan verify --hf HF_DIR [--hf-export]
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from .config.config import ConfigError, load_config

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
    """Train a model: `nanotitan train [--config FILE] [--section.key VALUE ...]`.

    With no torchrun around it, starts parallel.dp*pp*ep*tp*cp local ranks itself; under torchrun (any number of
    nodes) it runs as one rank; under Slurm's `srun --ntasks-per-node 1` it is its node's torchrun agent.
    Writes RUN_DIR/metrics.jsonl, config.toml, summary.json and checkpoints (run.dir)."""
    from .run.launch import slurm_rendezvous, under_torchrun
    from .config.fits import does_not_fit

    path, overrides = _split_config(argv)
    cfg = load_config(path, overrides)
    if cfg.elastic.endpoint and not under_torchrun():  # this process is its node's agent (elastic/agent.py)
        # The agent's console holds its own lines: torch's C++ warnings (a store connection that failed, with its
        # frames) are read once, at torch's import; its ranks keep them (in their logs).
        quiet = "TORCH_CPP_LOG_LEVEL" not in os.environ
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        _private_net(cfg, shared=True)  # before torch's import: a user namespace is entered with one thread only
        from .elastic.agent import run_agent

        if quiet:
            del os.environ["TORCH_CPP_LOG_LEVEL"]
        code = run_agent(cfg, ([f"--config={path}"] if path else []) + overrides)
        _exit_soon()
        return code
    from .resolve import planned_flags, resolve

    # The job's config, concrete (resolve.py): under parallel.auto the planner's layout for this world (under
    # torchrun WORLD_SIZE: an elastic restart on another world re-plans, and resume reshards onto it); device,
    # threads for the ranks on this host, zero choices, the emulated network (a bad profile fails here).
    planned = cfg.parallel.auto
    cfg = resolve(cfg, log=lambda line: print(line, flush=True))
    if why := does_not_fit(cfg):  # an absurd size: one line with the GiB, before anything is allocated
        raise ConfigError(why)
    if cfg.train.export_hf:  # the export at the end: its directory and the model checked before anything trains
        from .interop.hf import check_export_hf
        from .run.rundir import writable_dir

        check_export_hf(cfg)
        writable_dir(cfg.train.export_hf, "--train.export_hf")
    if planned:  # the ranks this process starts run the planned layout instead of planning again
        argv = ([f"--config={path}"] if path else []) + overrides + planned_flags(cfg)

    from .config.config import to_toml
    from .run.rundir import LOCK_ENV, owned_run_dir, settle_resume

    # train.resume's default made concrete: continue this run dir's own checkpoints (the same command run again, or a
    # restarted attempt), else start fresh; another config's are refused. Every rank settles it alike from the same
    # files; the line is the launcher's (its ranks find LOCK_ENV set), or rank 0's under an outside torchrun.
    cfg.train.resume, line = settle_resume(cfg.run.dir, cfg.train.resume, cfg.run.overwrite, to_toml(cfg))
    if line and LOCK_ENV not in os.environ and int(os.environ.get("RANK", "0")) == 0:
        print(line, flush=True)

    if under_torchrun():
        from .run.launch import fail_rank, start_rank

        if os.environ.get("NANOTITAN_ELASTIC"):  # a rank of an elastic job's generation (elastic/rank.py)
            from .elastic.rank import run_rank as run
        else:
            from .train import run
        _die_with_parent()
        try:
            start_rank(cfg.run.dir, cfg.parallel.timeout_s)  # the comm record that names stalls; logs/rank_N.log
            with owned_run_dir(cfg.run.dir, cfg.train.resume, cfg.run.overwrite):  # rank 0, unless a launcher holds it
                run(cfg)
        except BaseException as e:  # noqa: BLE001 - fail_rank re-raises SystemExit; the rest ends the rank
            fail_rank(e)  # its one line for the launcher to show once; exits now, without a slow teardown
        _exit_soon()
        return 0
    rdzv = slurm_rendezvous(cfg.world_size)  # under srun: this process is its node's agent, None otherwise
    nproc = rdzv.nproc_per_node if rdzv else cfg.world_size  # ranks on this machine
    if cfg.world_size > 1:
        # Prepare the data once here, before the run dir is touched, so the ranks find it cached (and bad data
        # fails in one line with nothing started or created).
        from .data.prepare import prepare_data

        prepare_data(cfg.data)
    # One job owns the run dir (a lock for its whole life, no fresh run over old checkpoints): this process,
    # or the first node's agent under Slurm; the ranks it starts are told through the environment.
    with owned_run_dir(cfg.run.dir, cfg.train.resume, cfg.run.overwrite) if rdzv is None or rdzv.node_rank == 0 \
            else contextlib.nullcontext():
        code = _launch_and_sample(cfg, argv, nproc, rdzv)
    _exit_soon()
    return code


def _private_net(cfg, shared: bool) -> None:
    """A one-host job in a network namespace of its own (run/netns.py): its loopback reachable by its own processes
    only. An elastic job's agents share the first one's (RUN_DIR/elastic.net). Where the kernel refuses, or the
    ranks need the network (W&B), one line, and the job runs on the host's loopback."""
    from .run.loopback import is_loopback, split_endpoint
    from .run.netns import NET_FILE, enter_private_net

    if cfg.elastic.endpoint and not is_loopback(split_endpoint(cfg.elastic.endpoint)[0]):
        return
    if cfg.run.wandb:
        line = "run.wandb: the ranks log over the network, so the job listens on the host's loopback (docs/security.md)"
    else:
        line = enter_private_net(Path(cfg.run.dir) / NET_FILE if shared else None)
    if line:
        print(f"nanotitan: {line}", file=sys.stderr, flush=True)


def _launch_and_sample(cfg, argv: list[str], nproc: int, rdzv) -> int:
    from .resolve import cpu_peak_for_ranks
    from .run.launch import launch_local

    cpu_peak_for_ranks(cfg)  # CPU: the MFU peak, measured once for this launch's ranks (and bf16 advice)
    if cfg.world_size > 1:
        if rdzv is None:  # one machine: its store and ranks in a network namespace of their own
            _private_net(cfg, shared=False)
        code = launch_local(nproc, argv, cfg.train.max_restarts, rdzv, run_dir=cfg.run.dir,
                            ckpt_on_signal=cfg.train.ckpt_on_signal)
    else:
        import signal

        from .run.launch import stop_line
        from .train import run

        try:
            stopped = run(cfg)["stopped"]
        except KeyboardInterrupt:  # Ctrl-C: one line naming the newest complete checkpoint, no traceback
            print(f"nanotitan: {stop_line(signal.SIGINT, cfg.run.dir, argv)}", file=sys.stderr)
            return 130
        if stopped:  # SIGTERM with train.ckpt_on_signal: saved, say where and how to go on
            print(f"nanotitan: {stop_line(signal.SIGTERM, cfg.run.dir, argv, saved=True)}", file=sys.stderr)
            return 143
        code = 0
    if code == 0 and cfg.train.sample_tokens > 0 and (rdzv is None or rdzv.node_rank == 0):
        from .config.errors import CheckpointError
        from .generate import generate_from_run

        try:
            text = generate_from_run(cfg.run.dir, "\n", cfg.train.sample_tokens)
            print("\n--- sample from the trained model ---\n" + text.strip()
                  + "\n-------------------------------------")
        except (ConfigError, CheckpointError) as e:
            print(f"(no sample: {e})")
    return code


def warm_rank() -> int:
    """A rank started ahead of its generation (each agent keeps one set warm): it does the imports, most of a
    rank's start (torch, the trainer), while it waits; then it reads its assignment, one JSON line
    {"argv", "env"} on stdin, and runs as `nanotitan train <argv>` would. An empty stdin: not needed, exit 0."""
    from .elastic.rank import WARM_ENV

    _die_with_parent()
    Path(os.environ.pop(WARM_ENV)).touch()
    line = sys.stdin.readline()
    if not line:
        return 0
    job = json.loads(line)
    os.environ.update(job["env"])
    return main(["train", *job["argv"]])


def _exit_soon() -> None:
    """The process exits next: spare it the interpreter's final GC over torch's heap, which took 2-7 s on a
    loaded machine (0.3 s frozen), added to every job's end and to a stall's detection time."""
    import gc

    gc.freeze()


def _die_with_parent() -> None:
    """A rank must not outlive its torchrun agent (killed agent -> orphans training forever): ask Linux for
    SIGKILL when the parent dies."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def cmd_data(argv: list[str]) -> int:
    """Prepare a corpus: `nanotitan data prepare [--config FILE] [--data.KEY VALUE ...] [--init.from_hf DIR]`.

    Trains (or loads) the tokenizer and writes the tokenized train/val files to the cache; `nanotitan train`
    prepares on first use too, so this is only needed to do it ahead of a job. With --data.mix 'A:0.7,B:0.3' it
    prepares every source of the mix with one tokenizer (the first source's BPE, or data.tokenizer), which a
    mix needs before `train` (docs/data.md). With --init.from_hf DIR the data is encoded with that model's tokenizer."""
    if not argv or argv[0] != "prepare":
        raise ConfigError("usage: nanotitan data prepare [--config FILE] [--data.source SRC] [--data.vocab_size N]")
    from .data.prepare import prepare_data, prepare_mix, prepared_summary

    from .config.hf_config import resolve_model

    path, overrides = _split_config(argv[1:])
    cfg = resolve_model(load_config(path, overrides))  # init.from_hf: the data is encoded with its tokenizer
    for out in prepare_mix(cfg.data) if cfg.data.mix else [prepare_data(cfg.data)]:  # a mix: each of its sources
        print(prepared_summary(out))
    return 0


def cmd_generate(argv: list[str]) -> int:
    import argparse

    from .generate import Sampling, generate_from_run

    ap = argparse.ArgumentParser(prog="nanotitan generate", description="Continue a prompt with a run's newest "
                                 "checkpoint (or a transformers checkpoint dir), KV-cached, on one process.")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--run.dir", dest="run_dir", help="the run directory of `nanotitan train`")
    src.add_argument("--init.from_hf", dest="from_hf", help="a transformers checkpoint dir (docs/hf.md)")
    ap.add_argument("--prompt", default="\n", help="the text to continue (default: a newline)")
    ap.add_argument("--max-new-tokens", "--tokens", dest="tokens", type=int, default=200,
                    help="how many tokens to generate (default: 200)")
    ap.add_argument("--greedy", action="store_true", help="take the likeliest token each time: no draw, no seed")
    ap.add_argument("--temperature", type=float, default=0.8, help="divides the logits before the draw; above 0 "
                    "(default: 0.8)")
    ap.add_argument("--top-k", type=int, default=50, help="draw among the k likeliest tokens; 0 keeps all "
                    "(default: 50)")
    ap.add_argument("--top-p", type=float, default=1.0, help="draw among the likeliest tokens whose probabilities "
                    "reach p, in (0, 1]; 1 keeps all (default: 1)")
    ap.add_argument("--seed", type=int, default=None, help="seeds the draws (default: the run's train.seed)")
    ap.add_argument("--format", choices=("text", "sft"), default="text", help="text: print the prompt and its "
                    "continuation; sft: the answer alone, up to its end of text, as data.format=sft trained it")
    args = ap.parse_args(argv)
    if args.tokens < 0:
        raise ConfigError(f"--max-new-tokens {args.tokens} must be >= 0")
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.greedy, args.seed)
    sampling.check()  # before any weight is read
    if args.from_hf:  # the imported weights, sampled with the imported tokenizer
        from .data.tokenizer import load_tokenizer_file
        from .generate import sample
        from .interop.hf import load_pretrained

        cfg, model = load_pretrained(args.from_hf)
        if not cfg.data.tokenizer:  # load_pretrained needs none; encoding the prompt does
            raise ConfigError(f"init.from_hf={args.from_hf!r} has no tokenizer.json to encode the prompt with (save "
                              "the model's fast tokenizer there: tokenizer.save_pretrained(DIR))")
        print(sample(model, load_tokenizer_file(cfg.data.tokenizer), args.prompt, args.tokens,
                     sampling.seeded(cfg.train.seed), args.format))
        return 0
    print(generate_from_run(args.run_dir, args.prompt, args.tokens, sampling=sampling, fmt=args.format))
    return 0


def cmd_export(argv: list[str]) -> int:
    import argparse

    from .interop.hf import DTYPES, export_checkpoint, export_target

    ap = argparse.ArgumentParser(prog="nanotitan export", description="Write a run's checkpoint (any layout) as a "
                                 "transformers checkpoint dir: config.json, safetensors, tokenizer (docs/hf.md).")
    ap.add_argument("--run.dir", dest="run_dir", required=True, help="the run directory of `nanotitan train`")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="tensor dtype on disk (default: fp32)")
    ap.add_argument("--force", action="store_true", help="write into a directory that is not empty (the export's "
                    "files are replaced, others stay)")
    args = ap.parse_args(argv)
    from .run.rundir import writable_dir

    target = export_target(args.out, args.force, "--out", "export into a new or empty directory, or add --force to "
                           "write over it")
    out = export_checkpoint(args.run_dir, writable_dir(target, "--out"), args.step, args.dtype)
    print(f"exported {args.run_dir} to {out}")
    return 0


def cmd_eval(argv: list[str]) -> int:
    """Loss and perplexity of a run's checkpoint on a held-out set:
    `nanotitan eval --run.dir R [--step N] [--data.source S | --data.mix M] [--section.key VALUE ...]`.

    The val split of the run's data, or of --data.source / --data.mix encoded with the run's tokenizer:
    train.eval_batches global batches of the run's size, so the loss is the val_loss training logs. On one process,
    or on the layout --parallel.dp/pp/ep/tp/cp name (local ranks, or torchrun's); the checkpoint is resharded onto it.
    --step N reads step N's checkpoint (default: the newest). Details: docs/eval.md."""
    from .evaluate import eval_config, eval_line, eval_rank, evaluate_checkpoint
    from .run.launch import under_torchrun

    run_dir, step, overrides = _split_eval(argv)
    cfg, path = eval_config(run_dir, step, overrides)
    if under_torchrun():
        from .run.launch import fail_rank, start_rank

        _die_with_parent()
        start_rank(str(Path(run_dir) / "eval"), cfg.parallel.timeout_s)
        try:
            eval_rank(cfg, path)
        except BaseException as e:  # noqa: BLE001 - fail_rank re-raises SystemExit; the rest ends the rank
            fail_rank(e)
        _exit_soon()
        return 0
    if cfg.world_size > 1:
        from .data.prepare import prepare_data
        from .run.launch import launch_local

        prepare_data(cfg.data)  # once, here: bad data fails in one line before any rank starts
        return launch_local(cfg.world_size, argv, run_dir=str(Path(run_dir) / "eval"), command="eval")
    print(eval_line(evaluate_checkpoint(cfg, path), cfg, path))
    return 0


def _split_eval(argv: list[str]) -> tuple[str, int | None, list[str]]:
    """`nanotitan eval`'s argv as (--run.dir, --step or None, the --section.key overrides)."""
    run_dir, step, rest, i = None, None, [], 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        if flag in ("--run.dir", "--step"):
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{flag} needs a value ({flag} {'RUN_DIR' if flag == '--run.dir' else 'N'})")
                value, i = argv[i + 1], i + 1
            if flag == "--step" and not value.isdigit():
                raise ConfigError(f"--step {value!r} must be a checkpoint's step number (--step 300)")
            run_dir, step = (value, step) if flag == "--run.dir" else (run_dir, int(value))
        else:
            rest.append(argv[i])
        i += 1
    if run_dir is None:
        raise ConfigError("nanotitan eval needs the run to read: --run.dir RUN_DIR")
    return run_dir, step, rest


# `nanotitan bench NAME`: the module under nanotitan/bench/ and what it measures (one home for benchmarks).
BENCHES = {
    "dp": "our bucketed Reducer / ZeRO levels vs torch DDP vs one process",
    "pp": "pipeline step time, bubble and activation memory per schedule",
    "ep": "one MoE layer under EP against its controls",
    "precision": "bf16 vs fp32: bytes on the wire per axis, step time and where it goes",
    "layouts": "every DP x PP x EP layout of N ranks at equal tokens per step: step time, memory, loss",
    "emulate": "the network emulator's measured vs modelled communication per layout and axis",
    "overlap": "parallel.ep_overlap against the same EP job without it, emulated and not",
    "gpu": "the MoE step at Mixtral shapes on one GPU: loop / grouped / compiled / nn.Linear",
    "compile": "train.compile: eager vs compiled blocks, side by side",
    "tp": "tensor parallel: ours vs torch's parallelize_module, SP's activation bytes, TP2 vs DP2",
    "cp": "context parallel attention: causal balance, ring overlap (emulated), ours vs all-gather KV and torch",
    "placement": "experts placed by load vs static vs capacity-capped, under the emulated network",
    "dispatch": "parallel.ep_dispatch static vs dynamic side by side, under the emulated network",
    "packed": "document-masked attention (SDPA per document) vs causal SDPA, forward + backward",
    "cp_docs": "CP over packed documents: the balanced split vs zigzag, attention work and time per rank",
}


def cmd_bench(argv: list[str]) -> int:
    """Benchmarks: `nanotitan bench NAME [...]`, NAME one of the benches below; `nanotitan bench NAME --help` shows
    its options."""
    names = ",".join(BENCHES)
    if not argv:
        raise ConfigError(f"usage: nanotitan bench {{{names}}} [...]")
    what, rest = argv[0], argv[1:]
    if what not in BENCHES:
        raise ConfigError(f"no benchmark {what!r} (choose one of {names})")
    import importlib

    return importlib.import_module(f".bench.{what}", __package__).main(rest)


def cmd_plan(argv: list[str]) -> int:
    from .plan.cli import main as plan_main

    return plan_main(argv)


def cmd_plot(argv: list[str]) -> int:
    from .observe.plot import main as plot_main

    return plot_main(argv)


def cmd_verify(argv: list[str]) -> int:
    """Check that a layout trains exactly what one process trains (docs/verify.md):
    `nanotitan verify [--layout dp=2,pp=2,ep=2] [--steps N] [--json PATH] [--config FILE] [--section.key VALUE ...]`.

    Runs the config on one process and on the layout (default: the config's own) for --steps steps (default 3) and
    compares every module's forward output, every gradient, every parameter and optimizer state after the update
    (first step) and each step's loss terms, grad norm, lr and skip verdict. Exit 0 equal, 1 diverged, 2 config
    error; the last line names the first tensor that diverges. `--fuzz N [--seed S] [--log PATH] [--chunk K]` verifies
    N configurations drawn from the whole composition space (the flags given fix the data and the rest);
    `--hf DIR [--hf-export]` checks a Hugging Face checkpoint's import (and export) against transformers."""
    from .verify.command import main as verify_main

    return verify_main(argv)


COMMANDS = {"train": cmd_train, "data": cmd_data, "generate": cmd_generate, "export": cmd_export, "eval": cmd_eval,
            "bench": cmd_bench, "plan": cmd_plan, "plot": cmd_plot, "verify": cmd_verify}


HELP = ("-h", "--help")
CONFIG_COMMANDS = ("train", "data", "verify")  # they read --config FILE and --section.key overrides


def usage() -> str:
    """`nanotitan --help`: the usage lines above and every registered command."""
    return (f"{USAGE.strip()}\n\ncommands: {', '.join(COMMANDS)}\n"
            "`nanotitan COMMAND --help` shows a command's options.")


def command_help(name: str) -> str | None:
    """`nanotitan NAME --help`: the command's docstring, plus every config key for the commands that read the
    config. None for a command without a docstring: it answers --help itself (argparse)."""
    import inspect

    doc = inspect.getdoc(COMMANDS[name])
    if doc is None:
        return None
    if name in CONFIG_COMMANDS:
        from .config.help import config_help

        doc += "\n\n" + config_help(only=("data",) if name == "data" else None)  # data prepare reads [data]
    if name == "bench":
        doc += "\n\nBenches:\n" + "\n".join(f"  {bench:<10} {what}" for bench, what in BENCHES.items())
    return doc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in HELP:
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"nanotitan: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    # `bench layouts --help` is the sub-command's own; train and data take --help anywhere among overrides.
    wants_help = (bool(rest) and rest[0] in HELP) or (name in CONFIG_COMMANDS and any(a in HELP for a in rest))
    if wants_help and (text := command_help(name)) is not None:
        print(text)
        return 0
    from .config.errors import EXIT_CODES, LABELS, CheckpointError, StorageError, TrainingError

    try:
        return COMMANDS[name](rest)
    except ConfigError as e:
        print(f"nanotitan: config error: {e}", file=sys.stderr)
        return 2
    except (TrainingError, CheckpointError, StorageError) as e:  # every rank agrees on it: one line, no traceback
        where = f"rank {os.environ['RANK']}: " if "RANK" in os.environ else ""
        print(f"nanotitan: {where}{LABELS[e.kind]}{e}", file=sys.stderr)
        return EXIT_CODES[e.kind]


if __name__ == "__main__":
    sys.exit(main())
