#!/usr/bin/env python3
"""Loads a safetensors file written by fullshard-train-gpt (a sharded LibTorch GPT, saved with
--save-to) into the same model in Python and checks it against what fullshard computed with
those weights: the Python twin of fullshard::torch::Gpt (bench/torch/gpt_fsdp2.py) takes the
file by `model.load_state_dict(state, strict=True)` (every name and shape), and its loss on a
batch of tokens must equal, within 1e-5, the loss fullshard-train-gpt printed for the same
weights (--init-from the file) on the same batch (--batches): a tensor in the wrong place, of
the wrong layout or with the wrong values changes the loss.

Usage: check_python_load.py FILE D_MODEL LAYERS HEADS CONTEXT BATCHES LOSS
  BATCHES: the --batches file of that run (int64 tokens, one step of (batch, context + 1)).
  LOSS: the loss fullshard-train-gpt printed for its step 1.

Reads the file with safetensors.torch when that package is importable (the wheel venv of
bench/torch), else with the format's own definition (an 8-byte little-endian header size, a
JSON header of name -> dtype, shape, data_offsets, then the bytes), so that Debian's
python3-torch alone runs it in CI.
"""

import json
import os
import struct
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "torch"))
from gpt_fsdp2 import GPT  # noqa: E402

DTYPES = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16, "BF16": torch.bfloat16}


def read_safetensors(path):
    try:
        from safetensors.torch import load_file

        return load_file(path)
    except ImportError:
        pass
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    start = 8 + n
    header = json.loads(data[8:start])
    body = data[start:]
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        lo, hi = t["data_offsets"]
        dtype = DTYPES[t["dtype"]]
        out[name] = torch.frombuffer(bytearray(body[lo:hi]), dtype=dtype).reshape(t["shape"])
    return out


def main():
    path, d, layers, heads, context = sys.argv[1], *map(int, sys.argv[2:6])
    batches, want = sys.argv[6], float(sys.argv[7])
    state = read_safetensors(path)
    model = GPT(d_model=d, layers=layers, heads=heads, context=context)
    model.load_state_dict(state, strict=True)
    with open(batches, "rb") as f:
        tokens = f.read()
    ids = torch.tensor(struct.unpack("<%dq" % (len(tokens) // 8), tokens)).reshape(-1, context + 1)
    with torch.no_grad():
        loss = model.loss(ids).item()
    err = abs(loss - want) / abs(want)
    if not err <= 1e-5:
        sys.exit(f"FAIL: the loss in Python is {loss:.9f}, fullshard printed {want:.9f} (error {err:.2e})")
    print(f"python load: {len(state)} tensors, loss {loss:.9f} = fullshard's {want:.9f} "
          f"(error {err:.1e}; torch {torch.__version__})")


if __name__ == "__main__":
    main()
