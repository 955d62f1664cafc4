#!/usr/bin/env bash
# fullshard-train checks the files it writes at its end (--trace, --graph-out) before the first
# step: a path whose directory is missing, a directory, or an unwritable directory exits 2 on
# every rank naming the option and the path, and no step runs; a good path is written.
#   train_outputs.sh MPIEXEC TRAIN WORKDIR
set -uo pipefail
mpiexec="$1" train="$2" work="$3"
fail() { echo "FAIL: $*"; exit 1; }
rm -rf "$work" && mkdir -p "$work"
trap 'rm -rf "$work"' EXIT
flags=(--layers 2 --hidden 16 --inputs 8 --outputs 4 --batch 8 --steps 3 --log-every 1)
refused() {  # OPTION PATH EXPECTED-MESSAGE
  local out code
  out="$("$mpiexec" -n 2 "$train" "${flags[@]}" "$1" "$2" 2>&1)"
  code=$?
  [[ $code -eq 2 ]] || { echo "$out"; fail "$1 $2: exit code $code, not 2"; }
  grep -qF -- "$3" <<<"$out" || { echo "$out"; fail "$1 $2: no message '$3'"; }
  ! grep -q "^step " <<<"$out" || { echo "$out"; fail "$1 $2: steps ran before the refusal"; }
  echo "ok: $1 $2: $(grep -F -- "$3" <<<"$out" | head -1)"
}
refused --trace "$work/missing/t.json" "--trace '$work/missing/t.json': its directory '$work/missing' does not exist"
refused --trace "$work" "--trace '$work' exists and is not a regular file (a directory)"
refused --graph-out "$work/missing/g.json" "--graph-out '$work/missing/g.json': its directory"
# Root writes into a mode 0555 directory too: the unwritable case is a directory no one can
# write into, /proc.
refused --trace /proc/fullshard-trace.json "--trace '/proc/fullshard-trace.json': its directory '/proc' is not writable"
out="$("$mpiexec" -n 2 "$train" "${flags[@]}" --trace "$work/t.json" --graph-out "$work/g.json" 2>&1)" \
  || { echo "$out"; fail "good paths: exit $?"; }
[[ -s "$work/t.json" && -s "$work/g.json" ]] || fail "good paths: the files were not written"
[[ -z "$(ls -A "$work" | grep probe)" ]] || fail "a probe file was left behind"
echo "pass: outputs checked before the first step"
