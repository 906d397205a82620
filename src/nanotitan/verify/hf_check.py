"""`nanotitan verify --hf DIR [--hf-export]`: a Hugging Face checkpoint's conversion checked (docs/verify.md).

    import    DIR loaded as `nanotitan train --init.from_hf DIR` loads it (interop/hf.py); then every tensor of DIR
              against the parameter it became, read back through the export's name map (bitwise: a conversion
              copies), and every tensor of DIR consumed (none left over: an expert the import skipped would keep
              its random init, and its tensor would be left unread)
    logits    the imported model's logits on a fixed batch against transformers' own load of DIR (when transformers
              is installed), max |diff| <= 1e-5 of the logits' scale, fp32
    export    (--hf-export) the imported model written back (`save_pretrained`): every tensor bitwise DIR's, the
              same names, and transformers' logits of the export equal to its logits of DIR
"""

from __future__ import annotations

import importlib.util
import math
import shutil
import tempfile
from pathlib import Path

import torch

from ..config.hf_config import read_hf_config
from ..interop.deepseek import ignored_key
from ..interop.hf import hf_tensors, load_pretrained, read_tensors, save_pretrained
from .check import write_rows
from .compare import Row, verdict

LOGIT_TOL = 1e-5  # max |diff| over the logits' largest magnitude (tests/interop/test_hf.py's bar)


def tensor_rows(model, cfg, family: str, stored: dict[str, torch.Tensor], phase: str) -> list[Row]:
    """One row per parameter tensor as the checkpoint names it (its relative error against `stored`), then one for
    what `stored` holds that no parameter became."""
    rows, seen = [], set()
    for key, ours in hf_tensors(model, family):
        if key == "lm_head.weight" and key not in stored:
            key = "model.embed_tokens.weight"  # tie_word_embeddings: the head starts as the embedding's copy
        seen.add(key)
        if key not in stored:
            rows.append(Row(f"{phase} {key}", phase, 0, math.inf, 0.0, note="not in the checkpoint"))
            continue
        want = stored[key].float()
        got = ours.detach().float()
        note = "" if tuple(got.shape) == tuple(want.shape) else f"shape {tuple(got.shape)} vs {tuple(want.shape)}"
        rel = math.inf if note else float((got - want).norm() / want.norm()) if want.norm() > 0 else \
            float((got - want).norm())
        rows.append(Row(f"{phase} {key}", phase, 0, rel, 0.0, note=note))
    left = sorted(k for k in set(stored) - seen if not ignored_key(cfg.model, k))
    rows.append(Row(f"{phase}: every tensor consumed", phase, 0, math.inf if left else 0.0, 0.0,
                    note=f"{len(left)} left unread, e.g. {left[0]}" if left else ""))
    return rows


def hf_logits(d: Path, x: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()(x).logits


def logit_row(name: str, got: torch.Tensor, want: torch.Tensor) -> Row:
    err = float((got - want).abs().max())
    return Row(name, "logits", 0, err / float(want.abs().max()), LOGIT_TOL)


def check_hf(hf_dir: str, export: bool, json_path: str | None) -> int:
    d = Path(hf_dir).expanduser()
    family, _ = read_hf_config(d)
    cfg, model = load_pretrained(d)
    stored = read_tensors(d)
    rows = tensor_rows(model, cfg, family, stored, "import")
    have_transformers = importlib.util.find_spec("transformers") is not None
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.model.vocab_size, (2, min(16, cfg.model.max_seq_len)), generator=g)
    with torch.no_grad():
        ours, _ = model(x)
    theirs = hf_logits(d, x) if have_transformers else None
    if theirs is not None:
        rows.append(logit_row("logits against transformers", ours, theirs))
    if export:
        out = Path(tempfile.mkdtemp(prefix="nanotitan-hf-export-"))
        try:
            save_pretrained(model, cfg, out / "export")
            back = read_tensors(out / "export")
            rows += tensor_rows(model, cfg, family, back, "export")
            differ = sorted((set(stored) ^ set(back)) - {"lm_head.weight"})  # a tied head is exported untied
            rows.append(Row("export: the same tensor names", "export", 0, math.inf if differ else 0.0, 0.0,
                            note=f"{differ[:3]} differ" if differ else ""))
            if theirs is not None:
                rows.append(logit_row("export: transformers' logits against the import's", hf_logits(out / "export", x),
                                      theirs))
        finally:
            shutil.rmtree(out, ignore_errors=True)
    line = verdict(rows)
    what = "" if have_transformers else " (transformers not installed: logits not compared)"
    print(f"verify: {d} ({family}) imported{' and exported' if export else ''}{what}")
    for r in rows:
        if not r.ok:
            print(f"  {r.name}: rel {r.rel:.2g}{'; ' + r.note if r.note else ''}")
    print(line)
    if json_path:
        write_rows(json_path, rows, line, {"hf_dir": str(d), "family": family, "export": export})
    return 0 if line.startswith("verify: equal") else 1
