"""The user docs as data: their pages, links, headings' anchors and the commands of their how-tos.

A page's commands are the `nanotitan ...` lines (and torchrun's `-m nanotitan.cli ...`) of README.md's ```bash blocks
and of the ```bash blocks in each docs/ page's "## How to" section. A block whose info string says `check`
(```` ```bash check ````) is checked, not run: its commands are parsed and their configs validated at their layout
(what a multi-rank or long run would refuse first). Every other command runs, on tiny settings (`tiny_argv`).
`python tests/helpers/docs.py COMMANDS_JSON WORKDIR` is the runner: one process, each command through `cli.main`.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(\s*)(```+|~~~+)(.*)$")


def pages() -> list[Path]:
    """README.md and every Markdown page under docs/ (the dated logs and plans included)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose_lines(text: str, blank_code: bool = True) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, inline code spans blanked (unless asked not to)."""
    out, fence = [], None
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m and (fence is None or m.group(2).startswith(fence)):
            fence = None if fence else m.group(2)[:3]
            continue
        if fence is None:
            out.append((n, re.sub(r"`[^`]*`", "``", line) if blank_code else line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: links reduced to their text, markup and punctuation dropped, lower case,
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


@functools.cache
def anchors(path: Path) -> set[str]:
    """Every heading's anchor of a page (a repeated one gains -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    for _, line in prose_lines(path.read_text(), blank_code=False):
        if m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line):
            s = slug(m.group(1))
            seen[s] = seen.get(s, -1) + 1
    raw = {s for s in seen}
    return raw | {f"{s}-{i}" for s, n in seen.items() for i in range(1, n + 1)}


def broken_links(path: Path) -> list[str]:
    """'page:line: target (why)' for each relative link of `path` whose file or anchor does not exist."""
    bad = []
    text = path.read_text()
    # inline code blanked by prose_lines would hide links written inside backticks; links are read from prose only
    for n, line in prose_lines(text):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: outside the repository by design
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            where = f"{path.relative_to(ROOT)}:{n}: {target}"
            if not dest.exists():
                bad.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where} (no heading with anchor #{anchor})")
    return bad


@dataclass
class Command:
    page: str  # where it is written, page:line
    argv: list[str]  # after `nanotitan`
    check: bool  # parse and validate only


def _blocks(path: Path, how_to_only: bool) -> list[tuple[int, str, list[str]]]:
    """(first line number, info string, lines) of each ```bash block (in the "## How to" section when asked)."""
    out, section, fence, info, body, start = [], "", None, "", [], 0
    for n, line in enumerate(path.read_text().splitlines(), 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence, info, body, start = m.group(2)[:3], m.group(3).strip(), [], n + 1
        elif fence is not None and m and m.group(2).startswith(fence) and not m.group(3).strip():
            if info.split()[:1] == ["bash"] and (not how_to_only or section == "How to"):
                out.append((start, info, body))
            fence = None
        elif fence is not None:
            body.append(line)
        elif line.startswith("## "):
            section = line[3:].strip()
    return out


def commands(path: Path) -> list[Command]:
    """The nanotitan commands of a page's bash blocks (README: all of them; docs/: the how-to's)."""
    out = []
    for start, info, body in _blocks(path, how_to_only=path.name != "README.md" or path.parent != ROOT):
        joined, first = "", None
        for i, line in enumerate(body + [""]):
            if first is None:
                first = start + i
            joined += line.rstrip()
            if joined.endswith("\\"):
                joined = joined[:-1] + " "
                continue
            words = shlex.split(joined, comments=True) if joined.strip() else []
            joined, line_no, first = "", first, None
            if words[:1] == ["$"]:
                words = words[1:]
            if words and words[0] == "torchrun" and "nanotitan.cli" in words:
                words = ["nanotitan"] + words[words.index("nanotitan.cli") + 1:]
            if words and words[0].endswith("nanotitan"):  # nanotitan, .venv/bin/nanotitan
                out.append(Command(f"{path.relative_to(ROOT)}:{line_no}", words[1:], "check" in info.split()[1:]))
    return out


# --- the runner: one process, every command through cli.main --------------------------------------------------

TINY_MODEL = ["--model.d_model", "32", "--model.n_layers", "1", "--model.n_heads", "4", "--model.ffn_dim", "48",
              "--model.num_experts", "4", "--model.top_k", "2", "--data.vocab_size", "300"]
QUIET = ["--run.progress", "false", "--run.tensorboard", "false", "--train.sample_tokens", "0",
         "--train.eval_every", "0", "--run.log_every", "1"]


def _drop(argv: list[str], flag: str) -> list[str]:
    """argv without `flag VALUE`."""
    return _set(argv, flag, "")[:-2]


def _set(argv: list[str], flag: str, value: str) -> list[str]:
    """argv with `flag value` in place of any value the page gave it (or added)."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == flag:
            i += 2
        elif argv[i].startswith(flag + "="):
            i += 1
        else:
            out.append(argv[i])
            i += 1
    return out + [flag, value]


def tiny_argv(argv: list[str], work: Path, i: int) -> list[str]:
    """A command as the test runs it: tiny model and data, one step, its own run dir; commands that read a run read
    the tiny run made first (work/run-1)."""
    name, corpus = argv[0], str(work / "corpus")
    if name == "train":
        out = argv[1:] + TINY_MODEL + QUIET
        for flag, value in (("--train.steps", "1"), ("--train.seq_len", "16"), ("--train.micro_batch", "2"),
                            ("--run.dir", str(work / f"run{i}")), ("--data.source", corpus)):
            out = _set(out, flag, value)
        if "--train.export_hf" in out:
            out = _set(out, "--train.export_hf", str(work / f"hf{i}"))
        return ["train", *_mixed(out, work)]
    if name in ("generate", "eval", "export"):
        out = _set(argv[1:], "--run.dir", str(work / "run-1"))
        if name == "export":
            out = _set(out, "--out", str(work / f"hf{i}"))
        if name == "generate":
            out = _set(out, "--max-new-tokens", "4")
        if name == "eval":
            out = _set(_set(out, "--data.source", corpus), "--train.eval_batches", "2")
        return [name, *out]
    if name == "plan" and "--out" in argv:  # what plan writes (a profile, a table) goes to the test's folder
        argv = _set(argv, "--out", str(work / f"plan{i}.out"))
    if name == "plan" and "--what-if" in argv:  # one node, and no dry run (it builds a rank at the real shapes)
        return [*_set(argv, "--nodes", "1"), "--no-dry-run"]
    if name == "plot":
        return ["plot", str(work / "run-1"), "--out", str(work / f"plots{i}")]
    if argv[:2] == ["data", "prepare"]:
        out = _set(_set(argv[2:], "--data.source", corpus), "--data.vocab_size", "300")
        return ["data", "prepare", *_mixed(out, work)]
    return argv


def _mixed(argv: list[str], work: Path) -> list[str]:
    """A --data.mix of the page's sources becomes one of the two tiny corpora, at the page's weights."""
    if "--data.mix" not in argv:
        return argv
    weights = [part.rsplit(":", 1)[1] for part in argv[argv.index("--data.mix") + 1].split(",")]
    corpora = [str(work / "corpus"), str(work / "corpus_b")]
    return _set(argv, "--data.mix", ",".join(f"{c}:{w}" for c, w in zip(corpora, weights)))


def too_long(argv: list[str]) -> bool:
    """A train command of more than one rank (or a node's elastic agent): checked, not run (each rank is a process
    that imports torch; the equivalence tests run the layouts)."""
    if argv[0] == "bench":  # a benchmark runs for minutes: its options are checked (bench NAME --help)
        return len(argv) > 1
    if argv[0] == "verify":  # it runs a layout's ranks beside one process: its configs are checked
        return True
    if argv[0] == "eval":  # another layout than one process starts its ranks
        return any(a in argv and int(argv[argv.index(a) + 1]) > 1 for a in
                   ("--parallel.dp", "--parallel.pp", "--parallel.ep", "--parallel.tp", "--parallel.cp"))
    if argv[0] != "train":
        return False
    from nanotitan.cli import _split_config
    from nanotitan.config.config import load_config

    cfg = load_config(*_split_config(argv[1:]))
    return cfg.world_size > 1 or cfg.parallel.auto or bool(cfg.elastic.endpoint)


def check(argv: list[str], work: Path) -> None:
    """Parse and validate a command without running it: its config at its layout (train, data, eval, verify), its
    own flags (plan, bench: --help of the named bench)."""
    from nanotitan.cli import _split_config
    from nanotitan.config.config import load_config

    name = argv[0]
    if name in ("train", "eval"):
        path, overrides = _split_config(_drop(argv[1:], "--step") if name == "eval" else argv[1:])
        load_config(path, _set(overrides, "--data.source", str(work / "corpus")) if name == "eval" else overrides)
    elif argv[:2] == ["data", "prepare"]:
        path, overrides = _split_config(argv[2:])
        load_config(path, overrides)
    elif name == "verify":
        from nanotitan.verify.check import parse_layout
        from nanotitan.verify.command import split_flags

        own, overrides = split_flags(argv[1:])
        if "--layout" in own:
            parse_layout(own["--layout"])
        if "--hf" not in own:
            load_config(own.get("--config"), overrides)
    elif name == "bench":
        from nanotitan.cli import main

        assert main(["bench", argv[1], "--help"]) == 0, f"bench {argv[1]} --help failed"
    else:
        raise AssertionError(f"no check for `nanotitan {name}`: run it (a plain ```bash block)")


def run_all(cmds: list[dict], work: Path) -> list[dict]:
    """Each command in order: {page, argv, check, rc, error}."""
    import contextlib
    import io
    import os
    import time
    import traceback

    from nanotitan.cli import main

    os.chdir(ROOT)
    (work / "job.secret").write_bytes(os.urandom(32))
    (work / "job.secret").chmod(0o600)
    # the run the commands that read one read (generate, eval, export, plot): tiny, one step, a checkpoint
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(tiny_argv(["train"], work, -1)) == 0, "the tiny run the docs' commands read did not train"
    results = []
    for i, c in enumerate(cmds):
        argv = [a.replace("job.secret", str(work / "job.secret")) for a in c["argv"]]
        rc, error, out, t0 = 0, "", io.StringIO(), time.perf_counter()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                if c["check"] or too_long(argv):
                    check(argv, work)
                else:
                    rc = main(tiny_argv(argv, work, i))
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001 - reported with its page and line
            rc, error = 1, traceback.format_exc(limit=-3)
        results.append({**c, "rc": rc, "error": error or out.getvalue()[-1500:], "s": time.perf_counter() - t0,
                        "cpu_s": time.process_time()})
        print(f"{time.perf_counter() - t0:6.1f} s  {c['page']}: nanotitan {' '.join(c['argv'])[:100]}", file=sys.stderr,
              flush=True)
    return results


if __name__ == "__main__":
    work = Path(sys.argv[2])
    print(json.dumps(run_all(json.loads(Path(sys.argv[1]).read_text()), work)))
