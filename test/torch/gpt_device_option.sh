#!/usr/bin/env bash
# fullshard-train-gpt --device: "cpu" trains as without the option (the same losses, step for
# step); "cuda" where it cannot run is refused with a message (exit 2, a build without CUDA)
# or skipped (exit 77, a CUDA build on a machine without a GPU); anything else is a usage
# error naming the option. Usage: gpt_device_option.sh APP MPIEXEC
set -uo pipefail
app=$1 mpiexec=$2
fail() { echo "FAIL: $*"; exit 1; }
small=(--steps 3 --d-model 32 --layers 1 --heads 2 --context 16 --batch 4 --eval-every 0
       --eval-windows 2)
losses() { awk '/^step [0-9]+ loss/ { print $4 }'; }

plain=$("$mpiexec" -n 1 "$app" "${small[@]}") || fail "the run without --device failed"
cpu=$("$mpiexec" -n 1 "$app" "${small[@]}" --device cpu) || fail "--device cpu failed"
[[ $(losses <<<"$plain" | wc -l) -eq 3 ]] || fail "expected 3 step lines: $plain"
[[ "$(losses <<<"$plain")" == "$(losses <<<"$cpu")" ]] ||
  fail "--device cpu changed the losses: $(losses <<<"$plain" | xargs) vs $(losses <<<"$cpu" | xargs)"
echo "--device cpu: the same 3 losses as without the option"

out=$("$mpiexec" -n 1 "$app" "${small[@]}" --device cuda 2>&1)
rc=$?
if [[ $rc -eq 2 ]]; then
  grep -q -- "--device cuda: this fullshard-train-gpt was built without CUDA" <<<"$out" ||
    fail "exit 2 without the message: $out"
elif [[ $rc -eq 77 ]]; then
  grep -q "^SKIPPED: no CUDA device visible" <<<"$out" || fail "exit 77 without SKIPPED: $out"
else
  fail "--device cuda here: expected exit 2 (no CUDA build) or 77 (no GPU), got $rc: $out"
fi
echo "--device cuda: exit $rc: $(grep -m1 -E 'SKIPPED|--device' <<<"$out")"

out=$("$mpiexec" -n 1 "$app" "${small[@]}" --device=gpu 2>&1)
rc=$?
[[ $rc -eq 2 ]] || fail "--device=gpu: expected exit 2, got $rc: $out"
grep -q -- "--device expects cpu or cuda, got 'gpu'" <<<"$out" || fail "--device=gpu: $out"
echo "--device=gpu: exit 2: $(grep -m1 -- '--device' <<<"$out")"
echo "gpt device option: ok"
