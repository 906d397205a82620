"""`nanotitan bench gpu` at tiny shapes on CPU (the same code as on a GPU, so it cannot rot): every configuration
runs, its figures are finite and positive, and the grouped experts agree with the loop."""

import json
import math

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
