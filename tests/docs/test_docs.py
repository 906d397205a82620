"""The user docs hold: every relative link and anchor resolves, every command of README.md and of the pages' how-tos
runs (tiny settings) or, for a multi-rank or long one, parses and validates; each feature page opens with its how-to;
README's "Not supported yet" names no page that exists; each package docstring maps its modules; results.md rows
stay short; no tracker number and no file outside the repository is cited."""

import ast
import json
import os
import re
import subprocess
import sys
from dataclasses import asdict

import pytest

from tests.helpers.data import make_docs, write_txt
from tests.helpers.docs import ROOT, broken_links, commands, pages, prose_lines

# The pages of a feature: each opens with "## How to" (when, the flags, an example with its output, the limits).
FEATURES = ("calibration", "checkpoint", "compile", "cp", "data", "dp", "elastic", "emulate", "ep", "eval", "generate",
            "hf", "moe", "optim", "planner", "pp", "precision", "reliability", "security", "tools", "tp", "verify")


def test_every_link_and_anchor_resolves():
    bad = [b for p in pages() for b in broken_links(p)]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_the_link_check_can_fail(tmp_path, monkeypatch):
    import tests.helpers.docs as docs

    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## A section\n\n[ok](#a-section) [gone](#nowhere) [file](missing.md) `[code](x.md)`\n")
    monkeypatch.setattr(docs, "ROOT", tmp_path)
    assert [b.split(": ", 1)[1] for b in broken_links(page)] == ["#nowhere (no heading with anchor #nowhere)",
                                                                 "missing.md (no such file)"]


def test_feature_pages_open_with_a_how_to():
    for name in FEATURES:
        text = (ROOT / "docs" / f"{name}.md").read_text()
        first = next(line for _, line in prose_lines(text) if line.startswith("## "))
        assert first.strip() == "## How to", f"docs/{name}.md: its first section is {first!r}, not '## How to'"
        assert commands(ROOT / "docs" / f"{name}.md"), f"docs/{name}.md: its how-to has no nanotitan command"


def test_no_tracker_numbers_or_outside_files():
    bad = []
    for path in [*pages(), *sorted((ROOT / "src").rglob("*.py"))]:
        if "experiments" in path.parts or "plans" in path.parts:
            continue  # dated logs and plans on paper keep their history as written
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\bissue \d|DESIGN(\.md| §)|BASELINES|\.\./shared", line):
                bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not bad, "references to outside the repository:\n" + "\n".join(bad)


def test_not_supported_list_names_no_landed_page():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Not supported yet", 1)[1].split("\n## ", 1)[0]
    assert section.strip(), "README has no 'Not supported yet' list"
    planned = re.findall(r"planned\s+page:\s+(docs/[\w.-]+\.md)", section)
    landed = [p for p in planned if (ROOT / p).exists()]
    assert not landed, f"README says not supported yet, but {landed} exist: move those items out of the list"


def test_package_docstrings_map_every_module():
    missing = []
    for init in sorted((ROOT / "src" / "nanotitan").rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        here = init.parent
        names = [p.stem for p in here.glob("*.py") if p.name != "__init__.py"]
        names += [p.name for p in here.iterdir() if (p / "__init__.py").exists()]
        missing += [f"{here.relative_to(ROOT)}/{n}" for n in names if not re.search(rf"^\s*{n}(\.py|/|\s)", doc, re.M)]
    assert not missing, "modules their package's docstring does not map: " + ", ".join(missing)


def test_results_rows_are_short():
    long = [n for n, line in enumerate((ROOT / "docs" / "results.md").read_text().splitlines(), 1)
            if line.startswith("|") and len(line) > 300]
    assert not long, f"docs/results.md rows over 300 characters: lines {long}"


def test_every_command_runs_or_validates(tmp_path):
    """One process runs them all through cli.main (tests/helpers/docs.py): a command that errors fails here."""
    cmds = [asdict(c) for p in pages() if "experiments" not in p.parts and "plans" not in p.parts
            for c in commands(p)]
    assert len(cmds) >= 30, f"only {len(cmds)} commands found in README and the how-tos"
    write_txt(tmp_path / "corpus", make_docs(n_docs=16, words=200))
    write_txt(tmp_path / "corpus_b", make_docs(n_docs=8, words=200, seed=1))
    (tmp_path / "cmds.json").write_text(json.dumps(cmds))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "docs.py"), str(tmp_path / "cmds.json"),
                           str(tmp_path)], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = [f"{r['page']}: nanotitan {' '.join(r['argv'])}\n    rc {r['rc']}: {r['error'].strip()[-600:]}"
              for r in results if r["rc"] != 0]
    assert not failed, "commands in the docs that fail:\n" + "\n".join(failed)


def test_the_command_check_can_fail(tmp_path):
    """The check the long commands get refuses what a launch would refuse."""
    from nanotitan.config.config import ConfigError

    from tests.helpers.docs import check

    bad = (["train", "--no.such_key", "1"], ["train", "--parallel.ep", "3"], ["data", "prepare", "--data.nope", "1"])
    for argv in bad:
        with pytest.raises(ConfigError):
            check(argv, tmp_path)
