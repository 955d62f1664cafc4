#!/usr/bin/env bash
# fullshard-train checks its --checkpoint-dir before the first step (issue 29, item 1): an
# unwritable directory, a missing parent and a read-only file system exit 2 on every rank
# before any step line, naming the path and the reason; a file system with less free space
# than one checkpoint gets a warning before the first step. Needs root for the mounts (a
# read-only and a tiny tmpfs in a temporary directory, unmounted and removed at exit).
#   train_checkpoint_dir.sh MPIEXEC TRAIN
set -euo pipefail
mpiexec="$1" train="$2"
[[ "$(id -u)" -eq 0 ]] || { echo "FAIL: needs root (it mounts a read-only tmpfs)"; exit 1; }
work="$(mktemp -d /tmp/fullshard-ckptdir.XXXXXX)"
cleanup() {
  umount "$work/ro" 2>/dev/null || true
  umount "$work/tiny" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$work/ro" "$work/tiny"
mount -t tmpfs -o ro,size=1m tmpfs "$work/ro"
mount -t tmpfs -o size=64k tmpfs "$work/tiny"
small=(--layers 2 --hidden 64 --inputs 16 --outputs 4 --batch 16 --steps 3 --seed 1)
run() {  # run DIR: the output and "exit code N"
  "$mpiexec" -n 2 "$train" "${small[@]}" --checkpoint-dir "$1" 2>&1 && echo "exit code 0" ||
    echo "exit code $?"
}
expect_refused() {  # expect_refused DIR REASON
  local out
  out="$(run "$1")"
  grep -q "exit code 2" <<<"$out" || { echo "FAIL: $1: not exit 2"; echo "$out"; exit 1; }
  grep -q "$2" <<<"$out" || { echo "FAIL: $1: no '$2' in the message"; echo "$out"; exit 1; }
  if grep -q "^step " <<<"$out"; then echo "FAIL: $1: steps ran before the refusal"; echo "$out"; exit 1; fi
  echo "ok: $1 refused before the first step: $(grep -m1 "$2" <<<"$out")"
}
expect_refused /proc/fullshard-nowhere "checkpoint directory '/proc/fullshard-nowhere'"
expect_refused "$work/missing/ckpt" "its parent '$work/missing' does not exist"
expect_refused "$work/ro/ckpt" "cannot create it: Read-only file system"
mkdir "$work/ro-existing" && mount -t tmpfs -o ro,size=1m tmpfs "$work/ro-existing" 2>/dev/null
expect_refused "$work/ro-existing" "is not writable"
umount "$work/ro-existing"
# Less free space than a checkpoint: warned before the first step (the save then fails).
out="$(run "$work/tiny/ckpt")"
warn_line="$(grep -n "^fullshard: warning: checkpoint directory $work/tiny/ckpt has" <<<"$out" | cut -d: -f1 | head -1)"
step_line="$(grep -n "^step " <<<"$out" | cut -d: -f1 | head -1)"
[[ -n "$warn_line" && -n "$step_line" && "$warn_line" -lt "$step_line" ]] ||
  { echo "FAIL: no free-space warning before the first step"; echo "$out"; exit 1; }
echo "ok: $(grep -m1 "^fullshard: warning: checkpoint directory" <<<"$out")"
# A good directory: created, trained, saved.
out="$(run "$work/good")"
grep -q "exit code 0" <<<"$out" && [[ -f "$work/good/latest" ]] ||
  { echo "FAIL: a good directory"; echo "$out"; exit 1; }
ls -A "$work/good" | grep -q probe && { echo "FAIL: a probe file was left"; exit 1; }
echo "pass: checkpoint directory checks"
