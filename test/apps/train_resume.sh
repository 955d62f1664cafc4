#!/usr/bin/env bash
# fullshard-train resumed from a checkpoint continues the run it interrupted: 20 steps
# straight on N ranks against --stop-after 10 + checkpoint (sharded, on N ranks) + --resume to 20 on
# N ranks (the loss lines must be identical) and on each other "M[:mesh[:kind]]" case (relative
# 1e-6: another world size sums in another order).
#   train_resume.sh MPIEXEC TRAIN_BINARY N "3 4:2x2" [extra train flags...]
set -euo pipefail
mpiexec="$1" train="$2" n="$3" cases="$4"
shift 4
flags=(--layers 3 --hidden 48 --inputs 16 --outputs 4 --batch 30 --seed 11 --warmup 4 "$@")
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/train_run.sh"

run "$n" "$work/straight" --steps 20
run "$n" "$work/first" --steps 20 --stop-after 10 --checkpoint-dir "$work/ckpt" --save-every 5
grep -q "checkpoint: step 10 saved" "$work/first.log" \
  || { echo "FAIL: no 'checkpoint: step 10 saved' line:"; cat "$work/first.log"; exit 1; }
cmp -s <(head -10 "$work/straight") "$work/first" \
  || { echo "FAIL: the first 10 steps differ from the straight run"; exit 1; }

run "$n" "$work/same" --steps 20 --resume "$work/ckpt"
grep -q "resumed from .* at step 10" "$work/same.log" \
  || { echo "FAIL: no 'resumed ... at step 10' line:"; cat "$work/same.log"; exit 1; }
if ! cmp -s <(tail -n +11 "$work/straight") "$work/same"; then
  echo "FAIL: resumed on $n ranks: steps 11-20 differ from the straight run:"
  paste -d' ' <(tail -n +11 "$work/straight") "$work/same"
  exit 1
fi
echo "ok: $n ranks: 10 steps + checkpoint + 10 resumed steps print the straight run's losses"

status=0
for c in $cases; do
  IFS=: read -r m mesh kind <<<"$c"
  extra=()
  [[ -n "$mesh" ]] && extra+=(--mesh "$mesh")
  dir="$work/ckpt"
  if [[ -n "$kind" ]]; then  # save this kind on n ranks first
    dir="$work/ckpt-$kind"
    run "$n" "$work/first-$kind" --steps 20 --stop-after 10 --checkpoint-dir "$dir" --checkpoint-kind "$kind"
  fi
  run "$m" "$work/m$m" --steps 20 --resume "$dir" "${extra[@]}"
  if ! paste -d' ' <(tail -n +11 "$work/straight") "$work/m$m" | awk -v label="$m ranks${mesh:+ mesh $mesh}${kind:+ from a $kind checkpoint}" '
      NF != 4 || $1 != $3 { printf "FAIL: %s: step lines differ: %s\n", label, $0; bad = 1; next }
      { d = $2 - $4; if (d < 0) d = -d; a = $2 < 0 ? -$2 : $2
        if (d > 1e-6 * a) { printf "FAIL: %s: step %d loss %.9g, straight %.9g\n", label, $1, $4, $2; bad = 1 }
        else if (d / a > worst) worst = d / a }
      END { if (NR != 10) { printf "FAIL: %s: %d resumed steps, expected 10\n", label, NR; bad = 1 }
            if (!bad) printf "ok: resumed on %s: steps 11-20 within %.2e of the straight run\n", label, worst
            exit bad }'; then
    status=1
  fi
done
exit $status
