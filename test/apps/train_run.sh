# Sourced by the fullshard-train test scripts: run RANKS OUT [flags...] runs fullshard-train
# ("$train", launched by "$mpiexec" with the script's "${flags[@]}" first) on RANKS ranks, keeps
# its output in OUT.log and writes its "step loss" pairs to OUT; a failed run fails the test.
run() {  # run RANKS OUT [flags...]
  local ranks="$1" out="$2"
  shift 2
  "$mpiexec" -n "$ranks" "$train" "${flags[@]}" "$@" >"$out.log" 2>&1 \
    || { echo "FAIL: fullshard-train -n $ranks $* exited with an error:"; cat "$out.log"; exit 1; }
  awk '$1 == "step" && $3 == "loss" { print $2, $4 }' "$out.log" >"$out"
}
