#!/usr/bin/env bash
# fullshard-train-gpt checks its --checkpoint-dir before the first step (the session's check):
# an unwritable directory exits 2 on every rank naming the path, and no step runs.
#   gpt_checkpoint_dir.sh MPIEXEC PROGRAM
set -uo pipefail
mpiexec="$1" program="$2"
dir=/proc/fullshard-gpt-nowhere
out="$("$mpiexec" -n 2 "$program" --steps 3 --d-model 32 --layers 1 --heads 2 --context 16 \
  --batch 4 --checkpoint-dir "$dir" --save-every 1 2>&1)"
code=$?
echo "$out"
[[ $code -eq 2 ]] || { echo "FAIL: exit code $code, not 2"; exit 1; }
grep -q "checkpoint directory '$dir'" <<<"$out" || { echo "FAIL: the path is not named"; exit 1; }
if grep -q "^step " <<<"$out"; then echo "FAIL: steps ran before the refusal"; exit 1; fi
echo "gpt checkpoint dir: refused before the first step"
