#!/usr/bin/env bash
# fullshard-train --keep-last K (checkpoint::SaveOptions::keep_last): the K newest committed
# checkpoints of the run's lineage (its own and those of the chain it resumed) stay, older
# step directories of that lineage go once the new one is complete; the one `latest` names and
# the one the run resumed from are never deleted; a branch the run did not resume (`latest`
# pointed back at an older step) is another lineage and stays; .N names; 0 keeps all; a
# resumed run still loads. Leftovers of an interrupted save are cleaned as before.
#   train_keep_last.sh MPIEXEC TRAIN
set -euo pipefail
mpiexec="$1" train="$2"
flags=(--layers 2 --hidden 32 --inputs 8 --outputs 4 --batch 16 --seed 5)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/train_run.sh"
ck="$work/ckpt"
steps() { (cd "$ck" && ls -d step-* 2>/dev/null | tr '\n' ' ' | sed 's/ $//'); }
expect() {  # expect WHAT WANT
  local got
  got="$(steps)"
  [[ "$got" == "$2" ]] || { echo "FAIL: $1: step directories '$got', want '$2'"; exit 1; }
  echo "ok: $1: $got (latest: $(cat "$ck/latest"))"
}

run 2 "$work/a" --steps 10 --save-every 2 --keep-last 2 --checkpoint-dir "$ck"
expect "10 steps, a save every 2, --keep-last 2" "step-00000008 step-00000010"
[[ "$(cat "$ck/latest")" == "step-00000010" ]] || { echo "FAIL: latest"; exit 1; }

# Resumed from step 10 (protected), saving 12 and 14 with --keep-last 1.
run 2 "$work/b" --steps 14 --save-every 2 --keep-last 1 --resume "$ck" --checkpoint-dir "$ck"
grep -q "resumed from $ck/step-00000010 at step 10" "$work/b.log" || { cat "$work/b.log"; exit 1; }
expect "resumed at 10, --keep-last 1" "step-00000010 step-00000014"

# latest pointed back at step 10; resumed from it to 12: the newest (12) and 10 stay; 14 is
# run b's branch, which this run did not continue: not its to delete.
echo step-00000010 >"$ck/latest"
mkdir "$ck/.tmp-step-00000099"  # an interrupted save's leftover
run 2 "$work/c" --steps 12 --save-every 2 --keep-last 1 --resume "$ck" --checkpoint-dir "$ck"
expect "latest at an older step" "step-00000010 step-00000012 step-00000014"
[[ ! -e "$ck/.tmp-step-00000099" ]] || { echo "FAIL: the leftover stayed"; exit 1; }

# The same step again: step-00000012.1, and 10 (resumed from); 12 and 14 are other branches.
echo step-00000010 >"$ck/latest"
run 2 "$work/d" --steps 12 --save-every 2 --keep-last 2 --resume "$ck" --checkpoint-dir "$ck"
expect ".N names" "step-00000010 step-00000012 step-00000012.1 step-00000014"
[[ "$(cat "$ck/latest")" == "step-00000012.1" ]] || { echo "FAIL: latest is not 12.1"; exit 1; }

# --keep-last 0 (the default) keeps all; a resume from the pruned directory loads.
run 2 "$work/e" --steps 16 --save-every 2 --resume "$ck" --checkpoint-dir "$ck"
expect "--keep-last 0" \
  "step-00000010 step-00000012 step-00000012.1 step-00000014 step-00000014.1 step-00000016"
run 2 "$work/f" --steps 18 --resume "$ck"
grep -q "resumed from $ck/step-00000016 at step 16" "$work/f.log" || { cat "$work/f.log"; exit 1; }
echo "pass: checkpoint retention"
