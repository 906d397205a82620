#!/bin/bash
# Profile the default job's ranks in two or more trees at once (scripts/experiments/callprof/sitecustomize.py), then compare
# the first two:   scripts/experiments/callprof/run.sh TAG old=/tmp/old head=$PWD
# Writes /tmp/prof_NAME_TAG/rank*.prof (steps NT_PROF_FROM..NT_PROF_TO, default 20..40, of every rank); with
# NT_PROF_MODE=cpu, rank*.json (main-thread and garbage-collector CPU per step, no profiler) and prints cpu.py's lines.
set -u
tag=$1; shift
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-$here/../../../.venv/bin/python}
names=()
for spec in "$@"; do
  name=${spec%%=*}; root=${spec#*=}; names+=("$name")
  rm -rf /tmp/prof_${name}_$tag /tmp/profrun_${name}_$tag
  (cd /tmp && PYTHONPATH=$root/src:$here NT_PROF_DIR=/tmp/prof_${name}_$tag NANOTITAN_CACHE=/tmp/cache_$name \
     timeout 1200 "$py" -c "import sys; from nanotitan.cli import main; sys.argv[0] = 'nanotitan'; sys.exit(main())" \
     train --config "$root/configs/default.toml" --train.steps $(( ${NT_PROF_TO:-40} + 2 )) --train.eval_every 0 \
     --run.dir /tmp/profrun_${name}_$tag --run.progress false --run.tensorboard false --train.ckpt_at_end false \
     --train.sample_tokens 0 ${EXTRA:-} > /tmp/profrun_${name}_$tag.log 2>&1) &
done
wait
if [ "${NT_PROF_MODE:-calls}" = cpu ]; then
  "$py" "$here/cpu.py" $(for n in "${names[@]}"; do echo /tmp/prof_${n}_$tag; done)
else
  "$py" "$here/compare.py" /tmp/prof_${names[0]}_$tag /tmp/prof_${names[1]}_$tag $(( ${NT_PROF_TO:-40} - ${NT_PROF_FROM:-20} )) ${TOP:-60}
fi
