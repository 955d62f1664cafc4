#!/usr/bin/env bash
# fullshard-train --device: `--device cpu` is the default path (the same loss on every step,
# bit for bit, and the same step lines), an unknown device is refused with exit 2 naming the
# option, and `--device cuda` either trains (a CUDA build with a GPU: the CPU loss curve within
# 1e-4 relative on every step), or skips with exit 77 ("SKIPPED: no CUDA device", a CUDA
# build without a GPU), or is refused with exit 2 naming --device cuda (a build without CUDA).
#   train_device.sh MPIEXEC TRAIN_BINARY
set -uo pipefail
mpiexec="$1" train="$2"
flags=(--steps 6 --layers 2 --hidden 32 --inputs 8 --outputs 4 --batch 16 --seed 3)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
curve() { awk '$1 == "step" && $3 == "loss" { print $2, $4 }' "$1"; }

"$mpiexec" -n 1 "$train" "${flags[@]}" >"$work/default.log" 2>&1 || {
  cat "$work/default.log"; fail "the default run exited with an error"; }
"$mpiexec" -n 1 "$train" "${flags[@]}" --device cpu >"$work/cpu.log" 2>&1 || {
  cat "$work/cpu.log"; fail "--device cpu exited with an error"; }
[[ "$(curve "$work/default.log" | wc -l)" -eq 6 ]] || fail "the default run printed no 6 step lines"
cmp -s <(curve "$work/default.log") <(curve "$work/cpu.log") ||
  fail "--device cpu gave another loss curve than the default:"$'\n'"$(paste <(curve "$work/default.log") <(curve "$work/cpu.log"))"
# The same lines apart from the measured times and the process's resident memory (the memory
# table's baseline and process peak rows).
strip() { sed -E '/^  (baseline|process peak) /d; /^  [(]process peak measured/d; s/(step_ms|comm_ms) [0-9.]+//g; s/in [0-9.]+ s/in T s/; s/median step [0-9.]+ ms [(]comm [0-9.]+ ms[)]//; s/max RSS [0-9.]+ MiB//; s/, heap in use [0-9.]+ MiB//; s/ [0-9.]+ ms at [0-9.]+ GB[/]s//; s/measured median step [0-9.]+ ms = [0-9.]+ x//' "$1"; }
cmp -s <(strip "$work/default.log") <(strip "$work/cpu.log") ||
  fail "--device cpu printed other lines than the default:"$'\n'"$(diff <(strip "$work/default.log") <(strip "$work/cpu.log"))"
echo "ok: --device cpu is the default path (6 steps, the same losses and lines)"

"$mpiexec" -n 1 "$train" "${flags[@]}" --device tpu >"$work/tpu.log" 2>&1
rc=$?
[[ $rc -eq 2 ]] && grep -q -- "--device expects cpu or cuda, got 'tpu'" "$work/tpu.log" || {
  cat "$work/tpu.log"; fail "--device tpu: exit $rc, expected 2 and a message naming --device"; }
echo "ok: --device tpu is refused (exit 2, the option named)"

"$mpiexec" -n 1 "$train" "${flags[@]}" --device cuda >"$work/cuda.log" 2>&1
rc=$?
case $rc in
  2)
    grep -q -- "--device cuda: this fullshard-train was built without CUDA" "$work/cuda.log" || {
      cat "$work/cuda.log"; fail "--device cuda: exit 2 without the 'built without CUDA' message"; }
    echo "ok: --device cuda on a build without CUDA: exit 2, the option named" ;;
  77)
    grep -q "SKIPPED: no CUDA device" "$work/cuda.log" || {
      cat "$work/cuda.log"; fail "--device cuda: exit 77 without a SKIPPED line"; }
    echo "ok: --device cuda without a GPU: exit 77, SKIPPED" ;;
  0)
    paste -d' ' <(curve "$work/cpu.log") <(curve "$work/cuda.log") | awk '
      NF != 4 || $1 != $3 { print "FAIL: step lines differ: " $0; bad = 1; next }
      { d = $2 - $4; if (d < 0) d = -d; a = $2 < 0 ? -$2 : $2
        if ($4 != $4 || d > 1e-4 * a) { printf "FAIL: step %d: cuda %.9g, cpu %.9g\n", $1, $4, $2; bad = 1 }
        else if (d / a > worst) worst = d / a }
      END { if (NR != 6) { print "FAIL: " NR " step lines, expected 6"; bad = 1 }
            if (!bad) printf "ok: --device cuda: the cpu loss curve within %.2e relative\n", worst
            exit bad }' || { cat "$work/cuda.log"; exit 1; } ;;
  *)
    cat "$work/cuda.log"; fail "--device cuda: exit $rc" ;;
esac
