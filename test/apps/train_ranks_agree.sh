#!/usr/bin/env bash
# fullshard-train with one global batch gives the same loss curve on any number of ranks:
# runs the 1-rank reference, then each "N[:mesh]" case given, and compares every step's loss
# (relative 1e-5; f32 sums in another order differ by ~1e-7). Also checks the 1-rank run
# printed every step and a finite loss.
#   train_ranks_agree.sh MPIEXEC TRAIN_BINARY "2 3 4:2x2" [extra train flags...]
set -euo pipefail
mpiexec="$1" train="$2" cases="$3"
shift 3
flags=(--steps 10 --layers 3 --hidden 48 --inputs 16 --outputs 4 --batch 30 --seed 7 "$@")
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

run() {  # run N MESH OUT
  local mesh=()
  [[ -n "$2" ]] && mesh=(--mesh "$2")
  "$mpiexec" -n "$1" "$train" "${flags[@]}" "${mesh[@]}" >"$3.log" 2>&1 \
    || { echo "FAIL: fullshard-train on $1 ranks ${2:+(mesh $2) }exited with an error:"; cat "$3.log"; exit 1; }
  awk '$1 == "step" && $3 == "loss" { print $2, $4 }' "$3.log" >"$3"
}

run 1 "" "$work/ref"
if [[ "$(wc -l <"$work/ref")" -ne 10 ]]; then
  echo "FAIL: the 1-rank run printed $(wc -l <"$work/ref") step lines, expected 10:"
  cat "$work/ref.log"
  exit 1
fi
status=0
for c in $cases; do
  n="${c%%:*}" mesh=""
  [[ "$c" == *:* ]] && mesh="${c#*:}"
  run "$n" "$mesh" "$work/n$n"
  if ! paste -d' ' "$work/ref" "$work/n$n" | awk -v label="$n ranks${mesh:+ (mesh $mesh)}" '
      NF != 4 || $1 != $3 { printf "FAIL: %s: step lines differ: %s\n", label, $0; bad = 1; next }
      {
        ref = $2; got = $4; d = ref - got; if (d < 0) d = -d
        a = ref < 0 ? -ref : ref
        if (ref != ref || got != got || d > 1e-5 * a) {
          printf "FAIL: %s: step %d loss %.9g, 1 rank %.9g (relative difference %.2e > 1e-5)\n",
                 label, $1, got, ref, d / a; bad = 1
        } else if (d / a > worst) worst = d / a
      }
      END {
        if (NR != 10) { printf "FAIL: %s: %d step lines, expected 10\n", label, NR; bad = 1 }
        if (!bad) printf "ok: %s: 10 steps equal to 1 rank (largest relative difference %.2e)\n", label, worst
        exit bad
      }'; then
    status=1
  fi
done
exit $status
