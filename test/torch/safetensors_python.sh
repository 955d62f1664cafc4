#!/usr/bin/env bash
# A safetensors file written from a sharded LibTorch model (fullshard-train-gpt --save-to, 2
# ranks) loads into the same model in Python (Debian's python3-torch):
# test/torch/check_python_load.py. Usage: safetensors_python.sh APP MPIEXEC
set -euo pipefail
app=$1 mpiexec=$2
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py=/usr/bin/python3  # Debian's, with python3-torch (scripts/setup)
"$py" -c 'import torch' 2>/dev/null || { echo "FAIL: $py cannot import torch (python3-torch; run scripts/setup)"; exit 1; }
work=$(mktemp -d /tmp/fullshard-torch-st-XXXXXX)
trap 'rm -rf "$work"' EXIT
"$mpiexec" -n 2 "$app" --steps 3 --d-model 32 --layers 2 --heads 2 --context 16 --batch 4 \
  --eval-every 0 --eval-windows 2 --save-to "$work/w.safetensors"
"$py" "$here/check_python_load.py" "$work/w.safetensors" 32 2 2 16
