#!/usr/bin/env bash
# safetensors files between fullshard-ckpt and the Python package: Python writes a file
# (F32, F64, F16, BF16) -> fullshard-ckpt inspect, convert --from safetensors (full, and
# sharded on 3 files; checked against a graph) -> the checkpoints hold the reference values (read in Python from
# index.json and the data files) -> convert --to safetensors -> safetensors.numpy.load_file
# gives the reference values, laid out exactly as save_file lays them out. A file
# truncated by one byte is refused naming the file.
#   interop.sh PYTHON CKPT_BINARY
set -euo pipefail
py="$1" ckpt="$2"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ ! -x "$py" ]]; then
  echo "FAIL: $py is missing: run scripts/setup (it creates .venv with safetensors, numpy and ml_dtypes)"
  exit 1
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
interop() { "$py" "$here/interop.py" "$@"; }
ckpt() {
  "$ckpt" "$@" >"$work/out.log" 2>&1 || { echo "FAIL: fullshard-ckpt $*:"; cat "$work/out.log"; exit 1; }
  cat "$work/out.log"
}

interop write "$work/py.safetensors"
ckpt inspect "$work/py.safetensors" | grep -E "embed +BF16 +\(9, 3\)" \
  || { echo "FAIL: inspect does not list embed as BF16 (9, 3)"; exit 1; }

ckpt convert "$work/py.safetensors" "$work/full" --from safetensors
interop check-ckpt "$work/full/step-00000000"
ckpt convert "$work/py.safetensors" "$work/sh3" --from safetensors --to sharded --shards 3 --step 7
interop check-ckpt "$work/sh3/step-00000007"
ckpt verify "$work/sh3"

for d in full sh3; do
  ckpt convert "$work/$d" "$work/$d.safetensors" --to safetensors
  interop check-st "$work/$d.safetensors" --gen
done

# --graph: the graph of the file's tensors converts; one with another shape is refused.
graph() {  # graph EMBED_SHAPE FILE
  cat >"$2" <<JSON
{"name": "model", "params": {"embed": {"shape": $1, "dtype": "bf16"}},
 "modules": [{"name": "layers", "modules": [
               {"name": "0", "params": {"weight": {"shape": [6, 4]}, "bias": {"shape": [6]}}},
               {"name": "1", "params": {"weight": {"shape": [5, 6], "dtype": "f64"}}}]},
             {"name": "norm", "params": {"scale": {"shape": [7], "dtype": "f16"}}}]}
JSON
}
graph "[9, 3]" "$work/good.json"
graph "[3, 9]" "$work/bad.json"
ckpt convert "$work/py.safetensors" "$work/g" --from safetensors --graph "$work/good.json"
if "$ckpt" convert "$work/py.safetensors" "$work/g2" --from safetensors --graph "$work/bad.json" \
     >"$work/g2.log" 2>&1; then
  echo "FAIL: a graph with another shape was accepted"; exit 1
fi
grep -q "tensor 'embed': has shape (9, 3), the model's parameter is (3, 9)" "$work/g2.log" \
  || { echo "FAIL: unexpected message for a graph mismatch:"; cat "$work/g2.log"; exit 1; }
[[ ! -e "$work/g2" ]] || { echo "FAIL: a refused conversion left $work/g2"; exit 1; }

# Truncated by one byte: refused, naming the file.
head -c -1 "$work/py.safetensors" >"$work/cut.safetensors"
if "$ckpt" inspect "$work/cut.safetensors" >"$work/cut.log" 2>&1; then
  echo "FAIL: a truncated file was accepted"; exit 1
fi
grep -q "safetensors file $work/cut.safetensors: tensor '[^']*': data_offsets .* lie beyond the data region" "$work/cut.log" \
  || { echo "FAIL: unexpected message for a truncated file:"; cat "$work/cut.log"; exit 1; }
echo "safetensors interop with the Python package: ok"
