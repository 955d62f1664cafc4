#!/usr/bin/env bash
# fullshard-train-gpt and what it is given (issues 53 and 54): every refusal exits 2 before the
# first step, naming the option and the file.
#   --save-to, --write-config: a path it cannot write (checked before anything is built);
#   --batches: a file shorter than the run (checked by size before the run's batches are
#     allocated: here 100,000,000 steps, 54 GB), a token outside the vocabulary;
#   --init-from: weights holding a NaN;
#   --d-model too large for memory: refused from the model's keys before it is built.
#   gpt_inputs.sh MPIEXEC PROGRAM WORKDIR
set -uo pipefail
mpiexec="$1" program="$2" work="$3"
fail() { echo "FAIL: $*"; exit 1; }
rm -rf "$work" && mkdir -p "$work"
trap 'rm -rf "$work"' EXIT
gpt=(--d-model 32 --layers 1 --heads 2 --context 16 --batch 4 --eval-every 0)
refused() {  # EXPECTED-MESSAGE ARGS...
  local want="$1" out code
  shift
  out="$("$mpiexec" -n 2 "$program" "${gpt[@]}" "$@" 2>&1)"
  code=$?
  [[ $code -eq 2 ]] || { echo "$out"; fail "$*: exit code $code, not 2"; }
  grep -qF -- "$want" <<<"$out" || { echo "$out"; fail "$*: no message '$want'"; }
  ! grep -q "^step " <<<"$out" || { echo "$out"; fail "$*: steps ran before the refusal"; }
  echo "ok: $(grep -F -- "$want" <<<"$out" | head -1)"
}
refused "--save-to '$work/none/w.safetensors': its directory '$work/none' does not exist" \
  --steps 2 --save-to "$work/none/w.safetensors"
refused "--write-config '$work' exists and is not a regular file (a directory)" \
  --steps 2 --write-config "$work"
# 17 tokens a sequence, 4 sequences a step: one step's worth for a run of 10^8 steps.
python3 -c "import sys; sys.stdout.buffer.write(bytes(8 * 17 * 4))" >"$work/short.bin"
refused "--batches $work/short.bin: expected exactly 54400000000 bytes (100000000 steps x 4 sequences x 17 int64 tokens), the file has 544" \
  --steps 100000000 --batches "$work/short.bin"
python3 - "$work/vocab.bin" <<'PY'
import struct, sys
tokens = [5] * (2 * 4 * 17)
tokens[1 * 68 + 2 * 17 + 3] = 300  # step 2, sequence 2, position 3
open(sys.argv[1], "wb").write(struct.pack("<%dq" % len(tokens), *tokens))
PY
refused "--batches $work/vocab.bin: token 300 (step 2, sequence 2, position 3) is outside the vocabulary [0, 256)" \
  --steps 2 --batches "$work/vocab.bin"
# A model too large for the ranks' memory (--d-model 65536: 51.6 G parameters), refused from
# its keys before anything is built.
small=("${gpt[@]}")
gpt=(--d-model 65536 --layers 1 --heads 1 --context 16 --batch 4 --eval-every 0)
refused "the model (model.type = gpt, model.vocab = 256, model.context = 16, model.d_model = 65536, model.heads = 1, model.layers = 1, model.mlp_ratio = 4) has 51558416384 parameters" \
  --steps 2
gpt=("${small[@]}")
# Weights holding a NaN: a good file with one element of its first f32 tensor replaced.
"$mpiexec" -n 2 "$program" "${gpt[@]}" --steps 1 --save-to "$work/w.safetensors" >/dev/null 2>&1 \
  || fail "could not write the weights to poison"
name="$(python3 - "$work/w.safetensors" "$work/nan.safetensors" <<'PY'
import json, struct, sys
data = bytearray(open(sys.argv[1], "rb").read())
n = struct.unpack("<Q", data[:8])[0]
header = json.loads(data[8:8 + n])
name, t = next((k, v) for k, v in sorted(header.items()) if k != "__metadata__" and v["dtype"] == "F32")
at = 8 + n + t["data_offsets"][0] + 4 * 3  # its fourth element
data[at:at + 4] = struct.pack("<f", float("nan"))
open(sys.argv[2], "wb").write(data)
print(name)
PY
)"
[[ -n "$name" ]] || fail "no f32 tensor to poison"
refused "parameters hold a non-finite value: '$name'" --steps 2 --init-from "$work/nan.safetensors"
echo "gpt inputs: refused before the first step"
