#!/usr/bin/env bash
# One command on a CUDA machine (`make gpu-check`; docs/precision.md, "GPU check"):
#   1. the equivalence tests on NCCL through the real launcher (`python -m nanotitan.cli train`: torchrun, NCCL),
#      fp32 and bf16: tests/equivalence/test_equivalence_bf16.py::test_nccl_equivalence. With 1 GPU: the GPU run against
#      the CPU run; with 2+ GPUs: every layout that fits (world 2, 4, 8) against the single-GPU run.
#   2. a short MFU measurement of the MID and default models on one GPU, fp32 and bf16 (30 steps each).
#   3. one table of everything, also saved as $OUT/table.txt.
#   4. `nanotitan bench gpu`: the MoE step at Mixtral-8x7B shapes (2 layers, seq 4096, bf16): nn.Linear reference,
#      loop, grouped, each compiled or not (src/nanotitan/bench/gpu.py); $OUT/bench_gpu.{txt,json}.
# Without a CUDA device it says so and exits 0. The exit status is non-zero if any check failed.
# Needs no network: the text is a synthetic corpus written here. Environment: PYTHON (default .venv/bin/python),
# GPU_CHECK_OUT (default runs/gpu_check; emptied first).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu-check: skipped (torch sees no CUDA device)"
  exit 0
fi
OUT=${GPU_CHECK_OUT:-runs/gpu_check}
rm -rf "$OUT" && mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export NANOTITAN_GPU_CHECK_OUT="$OUT" NANOTITAN_CACHE="$OUT/cache"
status=0

echo "== gpu-check: $("$PY" -c 'import torch; print(torch.cuda.device_count(), "x", torch.cuda.get_device_name(0), "| torch", torch.__version__)')"

# --- 1. equivalence on NCCL ---------------------------------------------------------------------------------
"$PY" -m pytest -q -rs -p no:cacheprovider tests/equivalence/test_equivalence_bf16.py -k nccl 2>&1 | tee "$OUT/pytest.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# --- 2. MFU of MID and default on one GPU ----------------------------------------------------------------------
"$PY" -c "import sys; sys.path.insert(0, '.'); from tests.conftest import make_corpus; from pathlib import Path; make_corpus(Path('$OUT/corpus'))"
for model in mid default; do
  for dtype in fp32 bf16; do
    run="$OUT/mfu_${model}_${dtype}"
    # default.toml is DP2*PP2*EP2 with M=2: on one GPU, M=8 keeps its global batch of 16 sequences
    M=1; [ "$model" = default ] && M=8
    if ! "$PY" -m nanotitan.cli train --config "configs/$model.toml" --data.source "$OUT/corpus" \
        --train.device cuda --train.dtype "$dtype" --parallel.dp 1 --parallel.pp 1 --parallel.ep 1 \
        --parallel.microbatches "$M" --train.steps 30 --train.warmup_steps 5 --train.eval_every 0 \
        --train.sample_tokens 0 --train.ckpt_at_end false --run.log_every 5 --run.progress false \
        --run.tensorboard false --run.dir "$run" > "$run.log" 2>&1; then
      echo "gpu-check: MFU run $model $dtype failed (see $run.log)"; tail -5 "$run.log"; status=1
    fi
  done
done

# --- 3. one table ----------------------------------------------------------------------------------------------
"$PY" - "$OUT" <<'EOF' | tee "$OUT/table.txt"
import json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
rows = [json.loads(l) for l in (out / "rows.jsonl").read_text().splitlines()] if (out / "rows.jsonl").exists() else []
lines = [f"{'check':<18} {'dtype':<5} {'GPUs':>4}  {'layout':<28} {'result':<40} ok"]
for r in rows:
    res = f"max rel loss dev {r['max_rel_dev']:.2e} (bound {r['bound']:.1e})"
    lines.append(f"{r['check']:<18} {r['dtype']:<5} {r['gpus']:>4}  {r['layout']:<28} {res:<40} {'yes' if r['ok'] else 'NO'}")
if not rows:
    lines.append("NCCL equivalence   (no rows: see pytest.log)")
for model in ("mid", "default"):
    for dtype in ("fp32", "bf16"):
        f = out / f"mfu_{model}_{dtype}" / "metrics.jsonl"
        recs = [r for r in map(json.loads, f.read_text().splitlines()) if r.get("step", 0) >= 10] if f.exists() else []
        if not recs:
            lines.append(f"{'MFU':<18} {dtype:<5} {1:>4}  {model:<28} {'(run failed)':<40} NO")
            continue
        mfu = statistics.median(r["mfu"] for r in recs)
        tok = statistics.median(r["tokens_per_sec"] for r in recs)
        lines.append(f"{'MFU':<18} {dtype:<5} {1:>4}  {model:<28} {f'{100 * mfu:.2f}% MFU, {tok:,.0f} tok/s':<40} yes")
print("\n".join(lines))
EOF
# --- 4. the MoE step at real shapes -------------------------------------------------------------------------------
"$PY" -m nanotitan.cli bench gpu --json "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench_gpu.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu-check: bench gpu failed (see $OUT/bench_gpu.txt)"; status=1; }

echo "gpu-check: $([ $status -eq 0 ] && echo passed || echo FAILED) (details in $OUT)"
exit $status
