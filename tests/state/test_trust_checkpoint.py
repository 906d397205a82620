"""A checkpoint reads only itself (issue 49, item 5; docs/security.md "Disk"): a `.metadata` storage
`relative_path` must be a plain name its manifest lists (`../x` or an absolute path read any file into a tensor),
symlinks and non-regular files in a checkpoint or snapshot dir are refused, and verification reads only plain names
in the dir (a manifest naming /dev/zero hung every rank's verify)."""

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash

from nanotitan.state import checkpoint as ckpt
from nanotitan.state import manifest
from nanotitan.state.metadata import safe_load_metadata
from tests.helpers.specs import build_shard_spec
from tests.helpers.checkpoint import SAVE_KS, build, perturb, tiny_cfg


def _relist(step: Path, name: str, drop: str = "") -> None:
    """The manifest rewritten to match file `name` as it is now (whoever can write one can write the other)."""
    m = json.loads((step / manifest.MANIFEST).read_text())
    m["files"].pop(drop, None)
    data = (step / name).read_bytes()
    m["files"][name] = {"bytes": len(data), "xxh3_64": xxhash.xxh3_64_hexdigest(data)}
    (step / manifest.MANIFEST).write_text(json.dumps(m))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cfg = tiny_cfg()
    model, opt = build(cfg, build_shard_spec(cfg, 0, 0))
    perturb(model, opt, SAVE_KS)
    run = tmp_path_factory.mktemp("trust") / "run"
    return ckpt.save_checkpoint(run, 1, model, opt, None, cfg, {}), cfg


def _copy(saved, tmp_path) -> Path:
    step = tmp_path / "checkpoints" / "step_1"
    shutil.copytree(saved[0], step)
    return step


def _fresh(cfg):
    return build(cfg, build_shard_spec(cfg, 0, 0))


@pytest.mark.parametrize("where", ["../outside.distcp", "ABS"])
def test_a_relative_path_outside_the_checkpoint_is_refused(saved, tmp_path, where):
    """The shard moved out of the dir (or anywhere: an absolute path), `.metadata` pointing there and the manifest
    listing what is left: it verified and loaded the outside file; now refused in one line before any read."""
    step = _copy(saved, tmp_path)
    outside = tmp_path / "checkpoints" / "outside.distcp"
    (step / "__0_0.distcp").rename(outside)
    rel = str(outside) if where == "ABS" else where
    md = safe_load_metadata((step / ".metadata").read_bytes(), "m")
    for info in md.storage_data.values():
        info.relative_path = rel
    (step / ".metadata").write_bytes(pickle.dumps(md))
    _relist(step, ".metadata", drop="__0_0.distcp")
    assert manifest.verify_checkpoint(step) == ""  # every file it lists is there and matches
    model, opt = _fresh(saved[1])
    with pytest.raises(ckpt.CheckpointError, match=rf"^{step}/.metadata names '{rel}' as where a tensor's bytes "
                                                   r"are, which is not a file that manifest.json lists \(refused"):
        ckpt.load_checkpoint(step, model, opt, None)


def test_a_plain_name_the_manifest_does_not_list_is_refused(saved, tmp_path):
    step = _copy(saved, tmp_path)
    (step / "__0_0.distcp").rename(step / "__0_0.other")
    md = safe_load_metadata((step / ".metadata").read_bytes(), "m")
    for info in md.storage_data.values():
        info.relative_path = "__0_0.other"
    (step / ".metadata").write_bytes(pickle.dumps(md))
    _relist(step, ".metadata", drop="__0_0.distcp")
    model, opt = _fresh(saved[1])
    with pytest.raises(ckpt.CheckpointError, match="names '__0_0.other' as where a tensor's bytes are"):
        ckpt.load_checkpoint(step, model, opt, None)


def test_a_symlink_in_a_checkpoint_is_refused(saved, tmp_path):
    """A shard replaced by a symlink to the same bytes elsewhere verified and loaded through the link."""
    step = _copy(saved, tmp_path)
    elsewhere = tmp_path / "elsewhere.distcp"
    (step / "__0_0.distcp").rename(elsewhere)
    (step / "__0_0.distcp").symlink_to(elsewhere)
    line = "shard __0_0.distcp is a symlink or not a regular file (refused: a checkpoint reads only its own files)"
    assert manifest.verify_checkpoint(step) == line
    assert manifest.verify_checkpoint(step, checksums=False) == line
    model, opt = _fresh(saved[1])
    with pytest.raises(ckpt.CheckpointError, match=r"cannot load checkpoint .*: shard __0_0.distcp is a symlink"):
        ckpt.load_checkpoint(step, model, opt, None)
    (step / "__0_0.distcp").unlink()
    shutil.copy(elsewhere, step / "__0_0.distcp")
    (step / "manifest.json").rename(tmp_path / "m.json")
    (step / "manifest.json").symlink_to(tmp_path / "m.json")
    assert manifest.verify_checkpoint(step) == ("manifest.json is a symlink or not a regular file (refused: a "
                                                "checkpoint reads only its own files)")


_VERIFY = "import sys; from nanotitan.state.manifest import verify_checkpoint; print(verify_checkpoint(sys.argv[1]))"
_UNIT = ("import sys, pathlib; from nanotitan.state.manifest import unit_mismatch; "
         "print(unit_mismatch(pathlib.Path(sys.argv[1])))")


def _run(code: str, path: Path) -> str:
    """`code` in a process of its own: a read of /dev/zero or a FIFO never ends (it hung; the timeout fails it)."""
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_verification_reads_only_plain_names_in_the_dir(saved, tmp_path):
    """A manifest naming /dev/zero (0 bytes by stat, endless to read): every rank's verify hung; now one line."""
    step = _copy(saved, tmp_path)
    m = json.loads((step / manifest.MANIFEST).read_text())
    m["files"]["/dev/zero"] = {"bytes": 0, "xxh3_64": "0" * 16}
    (step / manifest.MANIFEST).write_text(json.dumps(m))
    assert _run(_VERIFY, step) == ("manifest.json names a path that is not a plain file name in this dir (refused: "
                                   "a checkpoint reads only its own files)")


def test_a_snapshot_unit_with_a_symlink_or_fifo_is_refused(saved, tmp_path):
    """A unit (elastic/snapshot.py) whose file is a symlink to /dev/zero, or a FIFO, named in its manifest: its
    check read forever; now it names the file."""
    unit = tmp_path / "step_1" / "g1-node0"
    shutil.copytree(saved[0], unit)
    (unit / "COMPLETE").unlink()
    assert _run(_UNIT, unit) == ""
    (unit / "config.toml").unlink()
    (unit / "config.toml").symlink_to("/dev/zero")
    assert _run(_UNIT, unit) == "config.toml is a symlink or not a regular file"
    (unit / "config.toml").unlink()
    os.mkfifo(unit / "config.toml")
    assert _run(_UNIT, unit) == "config.toml is a symlink or not a regular file"


def test_the_load_hands_dcp_the_metadata_it_checked(saved, tmp_path, monkeypatch):
    """`.metadata` swapped between its check and DCP's read, for one naming a file outside the checkpoint that holds
    other numbers (was: checked once, read twice: DCP read the outside file into the weights). The load acts on
    the Metadata it checked: the weights are the checkpoint's own."""
    step = _copy(saved, tmp_path)
    outside = tmp_path / "outside.distcp"
    planted = tmp_path / "planted.metadata"
    other, other_opt = _fresh(saved[1])
    perturb(other, other_opt, (5, 6))  # other numbers, the same shapes
    elsewhere = ckpt.save_checkpoint(tmp_path / "other", 1, other, other_opt, None, saved[1], {})
    shutil.copy(elsewhere / "__0_0.distcp", outside)
    md = safe_load_metadata((elsewhere / ".metadata").read_bytes(), "m")
    for info in md.storage_data.values():
        info.relative_path = str(outside)
    planted.write_bytes(pickle.dumps(md))
    checked = ckpt.storage_outside

    def check_then_swap(path, storage_data):
        why = checked(path, storage_data)
        shutil.copy(planted, step / ".metadata")  # the swap, right after the check
        return why

    monkeypatch.setattr(ckpt, "storage_outside", check_then_swap)
    model, opt = _fresh(saved[1])
    ckpt.load_checkpoint(step, model, opt, None, verify=False)
    want, want_opt = _fresh(saved[1])
    assert ckpt.load_checkpoint(saved[0], want, want_opt, None)["step"] == 1
    for (name, a), b, c in zip(model.named_parameters(), want.parameters(), other.parameters()):
        assert torch.equal(a, b) and not torch.equal(a, c), name
