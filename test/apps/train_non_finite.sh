#!/usr/bin/env bash
# fullshard-train --non-finite: a learning rate that makes the model overflow. skip: each bad
# step is skipped on every rank (a line, counted) and the run stops once more than
# --max-skipped were; stop: the first bad step ends the run naming it. No non-finite value is
# ever applied (the loss before the first bad step stays finite).
#   train_non_finite.sh MPIEXEC TRAIN
set -uo pipefail
mpiexec="$1" train="$2"
flags=(--layers 2 --hidden 32 --inputs 8 --outputs 4 --batch 16 --steps 14 --lr 1000
       --warmup 0 --optimizer sgd --momentum 0 --max-skipped 3)
fail() { echo "FAIL: $*"; exit 1; }
out="$("$mpiexec" -n 2 "$train" "${flags[@]}" 2>&1)" && { echo "$out"; fail "skip: exited 0"; }
echo "$out" | grep -E "^step|skipped|fullshard-train:"
[[ "$(grep -c '^step [0-9]* skipped (non-finite' <<<"$out")" -eq 3 ]] || fail "skip: not 3 skipped steps"
grep -q "step 6: rank [01]: the loss is not finite; the step was not applied (4 steps skipped, more than --max-skipped 3)" <<<"$out" || fail "skip: no stop after 3"
grep -q "^step 2 loss [0-9]" <<<"$out" || fail "skip: step 2's loss is not finite"
out="$("$mpiexec" -n 2 "$train" "${flags[@]}" --non-finite stop 2>&1)" && { echo "$out"; fail "stop: exited 0"; }
grep -q "step 3: rank [01]: the loss is not finite; the step was not applied (--non-finite stop)" <<<"$out" || { echo "$out"; fail "stop: no refusal"; }
! grep -q "^step [0-9]* skipped" <<<"$out" || fail "stop: a step was skipped"
echo "pass: non-finite steps never applied"
