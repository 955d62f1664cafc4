#!/usr/bin/env bash
# fullshard-train's memory account (docs/memory.md) on RANKS ranks: the summary's parts the
# library counts (shards, gradients, optimizer state, pool, windows) equal their planned values
# (ratio 1.000) for SGD and AdamW, f32 and bf16 compute and the optimizer inside backward; a
# --memory-budget below the planned peak stops every rank before the model is created (exit 2,
# the parts and the budget named, no header or step line), --memory-check warn runs it anyway.
#   train_memory.sh MPIEXEC TRAIN RANKS
set -euo pipefail
mpiexec="$1" train="$2" ranks="$3"
out="$(mktemp)"
trap 'rm -f "$out"' EXIT
flags=(--layers 3 --hidden 96 --inputs 16 --outputs 4 --batch 24 --steps 3 --seed 5)
fail() { echo "FAIL: $1"; cat "$out"; exit 1; }
check_parts() {  # check_parts LABEL ARGS...: every counted part's ratio is 1.000
  local label="$1"
  shift
  "$mpiexec" -n "$ranks" "$train" "${flags[@]}" "$@" >"$out" 2>&1 || fail "$label: exit $?"
  grep -q "^memory (rank 0, MiB)" "$out" || fail "$label: no memory table"
  for part in shards gradients "optimizer state" pool windows; do
    local line
    line="$(grep -E "^  $part +[0-9]" "$out")" || fail "$label: no '$part' row"
    # planned measured ratio; a part planned 0 has ratio "-" and must measure 0.0
    read -r planned measured ratio <<<"$(sed -E "s/^  $part +//" <<<"$line")"
    if [[ "$ratio" == "-" ]]; then
      [[ "$measured" == "0.0" ]] || fail "$label: $part planned 0, measured $measured"
    else
      [[ "$ratio" == "1.000" ]] || fail "$label: $part planned $planned, measured $measured"
    fi
  done
  grep -qE "^  optimizer state +0\.0 " "$out" && [[ "$*" == *adamw* ]] &&
    fail "$label: AdamW with no optimizer state"
  echo "ok: $label: $(grep -E '^  (shards|pool|windows) ' "$out" | tr -s ' ' | tr '\n' ';')"
}
check_parts "SGD" --optimizer sgd
check_parts "AdamW" --optimizer adamw
check_parts "AdamW, bf16 compute" --optimizer adamw --param-dtype bf16
check_parts "AdamW inside backward" --optimizer adamw --optimizer-in-backward

# Over the budget: every rank stops before creating the model.
set +e
"$mpiexec" -n "$ranks" "$train" "${flags[@]}" --memory-budget 1MiB >"$out" 2>&1
rc=$?
set -e
[[ $rc -eq 2 ]] || fail "a 1 MiB budget: exit $rc, not 2"
grep -q "memory: the planned peak of rank [0-9]*, .* (baseline .*, shards .*, gradients .*, optimizer state .*, pool .*, windows .*, activations .*), exceeds the memory a rank can have: 1.00 MiB on rank [0-9]* (--memory-budget)" "$out" ||
  fail "a 1 MiB budget: not the refusal's message"
if grep -qE "^(fullshard-train: [0-9]+ parameters|step )" "$out"; then
  fail "a 1 MiB budget: the model was created or a step ran"
fi
echo "ok: refused: $(grep -o 'memory: the planned peak[^;]*' "$out")"
"$mpiexec" -n "$ranks" "$train" "${flags[@]}" --memory-budget 1MiB --memory-check warn >"$out" 2>&1 ||
  fail "--memory-check warn: exit $?"
grep -q "fullshard: warning: the planned peak" "$out" || fail "--memory-check warn: no warning"
grep -q "^summary:" "$out" || fail "--memory-check warn: no summary"
echo "pass: memory account and budget on $ranks ranks"
