#!/usr/bin/env bash
# fullshard-train --async-save (checkpoint::save_async, issue 29 item 3): the checkpoints are
# those of synchronous saves byte for byte (FSDP and HSDP) with the same losses; a run resumed
# from one continues as a straight run; a rank killed, SIGTERM, and a full disk during an
# asynchronous save leave `latest` at the previous complete checkpoint (it verifies), from
# which a resumed run continues as the straight one. Needs root for the tmpfs mount.
#   train_async_save.sh MPIEXEC TRAIN CKPT
set -euo pipefail
mpiexec="$1" train="$2" ckpt="$3"
[[ "$(id -u)" -eq 0 ]] || { echo "FAIL: needs root (it mounts a small tmpfs)"; exit 1; }
flags=(--layers 2 --hidden 64 --inputs 16 --outputs 4 --batch 16 --seed 3)
work="$(mktemp -d /tmp/fullshard-async.XXXXXX)"
cleanup() {
  umount "$work/full" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/train_run.sh"
fail() { echo "FAIL: $*"; exit 1; }
# same_losses A B FROM: the losses of steps >= FROM in A equal those in B (as printed: %.9g).
same_losses() {
  local got want
  want="$(awk -v f="$3" '$1 >= f' "$2")"
  got="$(awk -v f="$3" '$1 >= f' "$1")"
  [[ -n "$want" && "$got" == "$want" ]] || { diff <(echo "$got") <(echo "$want"); fail "$1: losses from step $3 differ from $2"; }
}
latest_is() {  # latest_is DIR STEPDIR: and the checkpoint verifies
  [[ "$(cat "$1/latest")" == "$2" ]] || fail "$1/latest is '$(cat "$1/latest")', want $2"
  "$ckpt" verify "$1" >/dev/null || fail "$1 does not verify"
  local newest
  newest="$(cd "$1" && ls -d step-* | sort | tail -1)"
  [[ "$newest" == "$2" ]] || fail "$1: a later step directory appeared: $newest"
}

run 2 "$work/straight" --steps 12
# 1. The same files byte for byte and the same losses, FSDP and HSDP (2 replicas of 1 rank);
# the indexes differ only in the saving run's id (saved_by.run and .lineage, 16 hex digits).
same_checkpoints() {  # same_checkpoints DIR_A DIR_B
  diff -r -x 'index.json*' "$1" "$2" || return 1
  local f
  for f in "$1"/step-*/index.json; do
    diff <(sed -E 's/"[0-9a-f]{16}"/"RUN"/g' "$f") \
         <(sed -E 's/"[0-9a-f]{16}"/"RUN"/g' "$2/${f#"$1"/}") || return 1
  done
}
for mesh in 2 2x1; do
  run 2 "$work/sync-$mesh" --mesh "$mesh" --steps 8 --save-every 3 --checkpoint-dir "$work/ck-sync-$mesh"
  run 2 "$work/async-$mesh" --mesh "$mesh" --steps 8 --save-every 3 --checkpoint-dir "$work/ck-async-$mesh" --async-save
  same_checkpoints "$work/ck-sync-$mesh" "$work/ck-async-$mesh" || fail "--mesh $mesh: the checkpoints differ"
  same_losses "$work/async-$mesh" "$work/sync-$mesh" 1
  grep -q "staging memory" "$work/async-$mesh.log" || fail "no staging report"
  echo "ok: --mesh $mesh: asynchronous checkpoints (steps 3, 6, 8) equal the synchronous ones byte for byte"
done
# 2. Resumed from an asynchronous checkpoint: the straight run's losses.
run 2 "$work/first" --steps 12 --stop-after 6 --save-every 3 --checkpoint-dir "$work/ck" --async-save
latest_is "$work/ck" step-00000006
run 2 "$work/resumed" --steps 12 --resume "$work/ck"
same_losses "$work/resumed" "$work/straight" 7
echo "ok: resumed from an asynchronous checkpoint at step 6, steps 7-12 as the straight run"

# 3. A rank killed during an asynchronous save (rank 1's writer exits halfway through its
# file while training goes on): the job fails, `latest` stays at step 6.
cp -a "$work/ck" "$work/ck-kill"
if FULLSHARD_CKPT_FAULT=mid_shard@1 "$mpiexec" -n 2 "$train" "${flags[@]}" --steps 12 --save-every 3 \
    --resume "$work/ck-kill" --checkpoint-dir "$work/ck-kill" --async-save >"$work/kill.log" 2>&1; then
  cat "$work/kill.log"; fail "the killed job exited 0"
fi
grep -q "FULLSHARD_CKPT_FAULT=mid_shard: exiting" "$work/kill.log" || { cat "$work/kill.log"; fail "the fault did not fire"; }
grep -q "staged in" "$work/kill.log" || { cat "$work/kill.log"; fail "not killed during an asynchronous save"; }
latest_is "$work/ck-kill" step-00000006
run 2 "$work/after-kill" --steps 12 --resume "$work/ck-kill" --checkpoint-dir "$work/ck-kill" --async-save
same_losses "$work/after-kill" "$work/straight" 7
echo "ok: a rank killed while its writer was at work: latest stayed at step 6, the resumed run as the straight one"

# 4. SIGTERM (what Slurm sends at the time limit and before a requeue) to the job while its
# writers are at work (FULLSHARD_CKPT_FAULT=slow_write: each writer sleeps 3 s first).
cp -a "$work/ck" "$work/ck-term"
FULLSHARD_CKPT_FAULT=slow_write "$mpiexec" -n 2 "$train" "${flags[@]}" --steps 12 --save-every 3 \
  --resume "$work/ck-term" --checkpoint-dir "$work/ck-term" --async-save >"$work/term.log" 2>&1 &
job=$!
for _ in $(seq 600); do
  grep -q "staged in" "$work/term.log" && break
  sleep 0.05
done
grep -q "staged in" "$work/term.log" || { kill -KILL $job; cat "$work/term.log"; fail "no save was staged"; }
kill -TERM $job
if wait $job; then cat "$work/term.log"; fail "the job exited 0 after SIGTERM"; fi
latest_is "$work/ck-term" step-00000006
run 2 "$work/after-term" --steps 12 --resume "$work/ck-term"
same_losses "$work/after-term" "$work/straight" 7
echo "ok: SIGTERM during an asynchronous save: latest stayed at step 6, the resumed run as the straight one"

# 5. A full disk during an asynchronous save: a tmpfs that holds one checkpoint, not two.
bytes="$(du -sb "$work/ck/step-00000006" | cut -f1)"
mkdir -p "$work/full"
mount -t tmpfs -o size=$((bytes * 3 / 2)) tmpfs "$work/full"
if "$mpiexec" -n 2 "$train" "${flags[@]}" --steps 12 --save-every 3 --checkpoint-dir "$work/full/ck" \
    --async-save >"$work/full.log" 2>&1; then
  cat "$work/full.log"; fail "the job with a full disk exited 0"
fi
grep -q "No space left on device" "$work/full.log" || { cat "$work/full.log"; fail "no 'No space left on device'"; }
grep -q "checkpoint: step 3 saved" "$work/full.log" || { cat "$work/full.log"; fail "step 3 was not saved"; }
latest_is "$work/full/ck" step-00000003
echo "ok: a full disk during an asynchronous save: $(grep -m1 "No space left" "$work/full.log" | cut -c1-160)"
echo "pass: asynchronous checkpoint saves"
