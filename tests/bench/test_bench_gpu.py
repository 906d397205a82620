"""`nanotitan bench gpu` at tiny shapes on CPU (the same code as on a GPU, so it cannot rot): every configuration
runs, its figures are finite and positive, and the grouped experts agree with the loop."""

import json
import math

import pytest
import torch

from nanotitan.cli import main as cli_main


def test_bench_gpu_tiny(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert cli_main(["bench", "gpu", "--shape", "tiny", "--layers", "1", "--steps", "1", "--compile-backend", "eager",
                     "--peak-tflops", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "grouped vs loop, one MoE layer (output, weight gradients): max rel diff" in text
    diff = float(text.split("max rel diff ")[1].split()[0])
    assert diff <= 1e-2  # bf16 autocast: within one rounding
    rows = json.loads(out.read_text())["rows"]
    assert [r["config"] for r in rows] == ["reference", "loop", "grouped", "loop+compile", "grouped+compile"]
    for r in rows:
        assert r["step_s"] > 0 and math.isfinite(r["mfu"]) and r["tokens_per_s"] > 0
        assert set(r["split_s"]) == {"attention", "router", "dispatch", "experts", "combine", "optimizer", "other"}
        assert all(v >= 0 for v in r["split_s"].values())
        assert r["config"] in text


def test_bench_gpu_fp8_tiny(tmp_path, capsys):
    """--fp8 adds the loop+fp8 row; at tiny shapes on CPU it runs the same code a GPU runs."""
    pytest.importorskip("torchao")
    out = tmp_path / "rows.json"
    assert cli_main(["bench", "gpu", "--shape", "tiny", "--layers", "1", "--steps", "1", "--configs", "loop",
                     "--fp8", "rowwise", "--peak-tflops", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["config"] for r in rows] == ["loop", "loop+fp8"]
    assert all(r["step_s"] > 0 and math.isfinite(r["mfu"]) for r in rows)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FP8 MFU at real shapes needs a GPU")
def test_bench_gpu_fp8_cuda(tmp_path):
    """On a GPU (sm89+): the Mixtral-shaped layer in bf16 and FP8 rowwise, both rows measured."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need sm89 or newer")
    out = tmp_path / "rows.json"
    assert cli_main(["bench", "gpu", "--layers", "1", "--steps", "2", "--configs", "loop", "--fp8", "rowwise",
                     "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["config"] for r in rows] == ["loop", "loop+fp8"] and all(r["mfu"] > 0 for r in rows)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="--cuda-graphs records CUDA graphs: a GPU check")
def test_bench_gpu_cuda_graphs_rows(tmp_path):
    """--cuda-graphs adds the rows whose blocks replay as CUDA graphs; the grouped one leaves no more host syncs than
    the eager grouped step."""
    out = tmp_path / "rows.json"
    assert cli_main(["bench", "gpu", "--shape", "tiny", "--layers", "1", "--steps", "2", "--configs", "grouped",
                     "--cuda-graphs", "--peak-tflops", "1", "--json", str(out)]) == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["grouped", "grouped+graphs", "loop+graphs"]
    assert all(r["step_s"] > 0 and math.isfinite(r["mfu"]) for r in rows.values())
    assert rows["grouped+graphs"]["syncs"] <= rows["grouped"]["syncs"]


def test_bench_gpu_cuda_graphs_refused_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    with pytest.raises(SystemExit, match="CUDA graphs are recorded on a CUDA stream"):
        cli_main(["bench", "gpu", "--cuda-graphs"])
