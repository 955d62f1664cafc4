#!/usr/bin/env bash
# A safetensors file written from a sharded LibTorch model (fullshard-train-gpt --save-to, 2
# ranks) loads into the same model in Python (Debian's python3-torch) and gives the loss
# fullshard computes with it (--init-from) on the same batch: test/torch/check_python_load.py.
# Usage: safetensors_python.sh APP MPIEXEC
set -euo pipefail
app=$1 mpiexec=$2
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py=/usr/bin/python3  # Debian's, with python3-torch (scripts/setup)
"$py" -c 'import torch' 2>/dev/null || { echo "FAIL: $py cannot import torch (python3-torch; run scripts/setup)"; exit 1; }
work=$(mktemp -d /tmp/fullshard-torch-st-XXXXXX)
trap 'rm -rf "$work"' EXIT
"$mpiexec" -n 2 "$app" --steps 3 --d-model 32 --layers 2 --heads 2 --context 16 --batch 4 \
  --eval-every 0 --eval-windows 2 --save-to "$work/w.safetensors"
# The loss fullshard computes with those weights on a batch of its own tokens (4 sequences of
# 17), which the Python model must reproduce.
"$py" -c 'import struct, sys; sys.stdout.buffer.write(struct.pack("<68q", *[(7 * i * i + 3 * i) % 256 for i in range(68)]))' \
  >"$work/batch.bin"
out="$("$mpiexec" -n 2 "$app" --steps 1 --warmup 0 --d-model 32 --layers 2 --heads 2 --context 16 \
  --batch 4 --eval-every 0 --eval-windows 2 --init-from "$work/w.safetensors" \
  --batches "$work/batch.bin")"
echo "$out"
loss="$(sed -n 's/^step 1 loss \([0-9.]*\) .*/\1/p' <<<"$out")"
[[ -n "$loss" ]] || { echo "FAIL: no 'step 1 loss' line"; exit 1; }
"$py" "$here/check_python_load.py" "$work/w.safetensors" 32 2 2 16 "$work/batch.bin" "$loss"
