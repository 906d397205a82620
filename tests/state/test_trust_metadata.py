"""The `.metadata` allow-list cannot be bent (issue 49, item 4; docs/security.md "Disk"): pickle's BUILD on an
allowed class set attributes on the class itself (a refused load left `PosixPath.is_relative_to` bent for the rest
of the process), and a dtype name was looked up with getattr(torch, name), which imports torch subpackages."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from nanotitan.state.metadata import UnsafeMetadataError, safe_load_metadata

# GLOBAL pathlib.PosixPath; state (None, {"is_relative_to": PosixPath}); BUILD: setattr on the class, so that
# p.is_relative_to(q) became PosixPath(q), always true
BEND_POSIXPATH = b"cpathlib\nPosixPath\nN}Vis_relative_to\ncpathlib\nPosixPath\ns\x86b."


def test_build_on_an_allowed_class_is_refused_and_leaves_it_unchanged():
    before = dict(vars(pathlib.PosixPath))
    with pytest.raises(UnsafeMetadataError, match=r"^x/.metadata holds a BUILD on pathlib.PosixPath \(sets "
                                                  r"attributes\), which is not checkpoint metadata$"):
        safe_load_metadata(BEND_POSIXPATH, "x/.metadata")
    assert dict(vars(pathlib.PosixPath)) == before
    assert not pathlib.PosixPath("/etc/passwd").is_relative_to("/run")


def test_build_only_sets_declared_fields_of_an_allowed_instance():
    # NEWOBJ MetadataIndex(), then BUILD {"__class__": ...}: not a field of MetadataIndex
    dc = b"ctorch.distributed.checkpoint.metadata\nMetadataIndex\n)\x81}V__class__\ncpathlib\nPosixPath\nsb."
    with pytest.raises(UnsafeMetadataError, match="a BUILD of MetadataIndex with state other than its fields"):
        safe_load_metadata(dc, "x/.metadata")
    # a PosixPath instance (REDUCE) is not a dataclass: no BUILD on it either
    inst = b"cpathlib\nPosixPath\n(V/tmp\ntR}V_raw_paths\n]sb."
    with pytest.raises(UnsafeMetadataError, match="a BUILD on a PosixPath"):
        safe_load_metadata(inst, "x/.metadata")
    # SETITEM onto something that is not a plain dict (here a class: its item assignment is its own code)
    onto = b"cpathlib\nPosixPath\nVa\nVb\ns."
    with pytest.raises(UnsafeMetadataError, match="items added to a type, not a dict"):
        safe_load_metadata(onto, "x/.metadata")
    assert "is_relative_to" not in vars(pathlib.PosixPath)


def test_a_real_metadata_still_loads(tmp_path):
    import torch.distributed.checkpoint as dcp

    sd = {"a": torch.zeros(3, 4), "b": torch.ones(2, dtype=torch.bfloat16), "c": torch.tensor(3, dtype=torch.int8)}
    with pytest.warns(UserWarning):
        dcp.save(sd, checkpoint_id=tmp_path, no_dist=True)
    md = safe_load_metadata((tmp_path / ".metadata").read_bytes(), "real/.metadata")
    assert [md.state_dict_metadata[k].properties.dtype for k in "abc"] == [torch.float32, torch.bfloat16, torch.int8]
    assert md.storage_meta.checkpoint_id == tmp_path


def test_a_dtype_name_outside_the_table_is_refused_without_importing_anything():
    """In a fresh process (this one may have imported torch._dynamo already): `torch._dynamo` and `torch.onnx` as
    globals are refused, and neither module is imported by the refusal."""
    code = ("import sys\nfrom nanotitan.state.metadata import UnsafeMetadataError, safe_load_metadata\n"
            "mods = ('torch._dynamo', 'torch.onnx')\nassert not any(m in sys.modules for m in mods)\n"
            "for name in ('_dynamo', 'onnx'):\n"
            "    try:\n        safe_load_metadata(b'ctorch\\n' + name.encode() + b'\\n.', 'x')\n"
            "    except UnsafeMetadataError as e:\n        print(e)\n"
            "print([m for m in mods if m in sys.modules])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["x holds torch._dynamo, which is not checkpoint metadata",
                                       "x holds torch.onnx, which is not checkpoint metadata", "[]"], out.stdout
