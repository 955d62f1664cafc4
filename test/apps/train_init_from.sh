#!/usr/bin/env bash
# fullshard-train --init-from: a run of N ranks saves a checkpoint after 10 steps; it is converted
# to safetensors (the Python package reads it: load_file equals the checkpoint's parameters,
# and those of the optimizer file its AdamW states, read in Python from its data files) and back to a checkpoint (--from safetensors). Then on
# each rank count M in MS, runs started from the safetensors file, from the original checkpoint
# and from the converted one print identical loss lines, which differ from a run from the seed's
# weights; across rank counts they agree within relative 1e-6. BF16 weights are cast into the
# f32 model (the run equals one from the same values stored as F32). A file of another model
# is refused naming the tensor.
#   train_init_from.sh MPIEXEC TRAIN CKPT PYTHON N "1 2 3"
set -euo pipefail
mpiexec="$1" train="$2" ckpt="$3" py="$4" n="$5" ms="$6"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ ! -x "$py" ]]; then
  echo "FAIL: $py is missing: run scripts/setup (it creates .venv with safetensors, numpy and ml_dtypes)"
  exit 1
fi
flags=(--layers 3 --hidden 48 --inputs 16 --outputs 4 --batch 30 --seed 11)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

source "$here/train_run.sh"

run "$n" "$work/trained" --steps 10 --checkpoint-dir "$work/ck"
"$ckpt" convert "$work/ck" "$work/w.safetensors" --to safetensors \
  --optimizer-out "$work/opt.safetensors" >/dev/null
"$py" "$here/../safetensors/interop.py" check-st "$work/w.safetensors" --ckpt "$work/ck/step-00000010"
"$py" "$here/../safetensors/interop.py" check-st "$work/opt.safetensors" --ckpt-states "$work/ck/step-00000010"
"$ckpt" convert "$work/w.safetensors" "$work/back" --from safetensors --to sharded --shards 3 >/dev/null

run 1 "$work/seed" --steps 5
for m in $ms; do
  run "$m" "$work/st$m" --steps 5 --init-from "$work/w.safetensors"
  grep -Eq "initialised from $work/w.safetensors \(safetensors\): [0-9]+ tensors" "$work/st$m.log" \
    || { echo "FAIL: no 'initialised from' line:"; cat "$work/st$m.log"; exit 1; }
  run "$m" "$work/ck$m" --steps 5 --init-from "$work/ck"
  run "$m" "$work/back$m" --steps 5 --init-from "$work/back"
  for other in ck back; do
    cmp -s "$work/st$m" "$work/$other$m" || {
      echo "FAIL: $m ranks: --init-from the safetensors file and from '$other' differ:"
      paste -d' ' "$work/st$m" "$work/$other$m"; exit 1; }
  done
  [[ $(wc -l <"$work/st$m") -eq 5 ]] || { echo "FAIL: $m ranks: not 5 step lines"; exit 1; }
  if [[ "$(head -1 "$work/st$m")" == "$(head -1 "$work/seed")" ]]; then
    echo "FAIL: $m ranks: the first loss equals the run from the seed's weights (weights not loaded?)"
    exit 1
  fi
  paste -d' ' "$work/st${ms%% *}" "$work/st$m" | awk -v m="$m" '
    { d = $2 - $4; if (d < 0) d = -d; a = $2 < 0 ? -$2 : $2
      if ($1 != $3 || d > 1e-6 * a) { printf "FAIL: %s ranks: %s\n", m, $0; bad = 1 } }
    END { exit bad }'
  echo "ok: $m ranks: --init-from safetensors = --init-from the checkpoint = --init-from the converted checkpoint: $(head -1 "$work/st$m")"
done

# BF16 weights go into the f32 model converted: the same run as from those values in F32.
"$py" "$here/../safetensors/interop.py" to-bf16 "$work/w.safetensors" "$work/w16.safetensors" \
  "$work/w32.safetensors" >/dev/null
run 2 "$work/b16" --steps 3 --init-from "$work/w16.safetensors"
run 2 "$work/b32" --steps 3 --init-from "$work/w32.safetensors"
grep -Eq "\(safetensors, [0-9]+ tensors cast to the model's dtype\)" "$work/b16.log" \
  || { echo "FAIL: no cast note:"; cat "$work/b16.log"; exit 1; }
cmp -s "$work/b16" "$work/b32" \
  || { echo "FAIL: --init-from BF16 weights and from the same values in F32 differ"; exit 1; }
cmp -s "$work/b16" <(head -3 "$work/st2") \
  && { echo "FAIL: BF16-rounded weights gave exactly the F32 run (not rounded?)"; exit 1; }
echo "ok: BF16 weights cast into the f32 model: $(head -1 "$work/b16")"

# Another model's weights: refused, naming the tensor.
if "$mpiexec" -n 2 "$train" "${flags[@]}" --hidden 40 --steps 1 --init-from "$work/w.safetensors" \
     >"$work/bad.log" 2>&1; then
  echo "FAIL: weights of another model were accepted"; exit 1
fi
grep -q "safetensors file $work/w.safetensors: tensor '[^']*': has shape" "$work/bad.log" \
  || { echo "FAIL: unexpected message for another model's weights:"; cat "$work/bad.log"; exit 1; }
echo "fullshard-train --init-from: ok"
