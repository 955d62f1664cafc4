"""Interoperability of fullshard's safetensors files with the Python `safetensors` package.

    interop.py write FILE               writes reference tensors (F32, F64, F16, BF16) with
                                        safetensors.numpy.save_file (BF16 through ml_dtypes)
    interop.py check-st FILE --gen      load_file(FILE) equals the reference tensors
    interop.py check-st FILE --ckpt DIR load_file(FILE) equals the parameters of the fullshard
                                        checkpoint step directory DIR, read here from its
                                        index.json and data files (an independent reader)
    interop.py check-st FILE --ckpt-states DIR
                                        the same for the optimizer states of DIR
                                        ("<fqn>.<state>")
    interop.py check-ckpt DIR           the checkpoint DIR holds the reference tensors
    interop.py to-bf16 IN OUT16 OUT32   IN's tensors rounded to BF16 (OUT16), and those values
                                        as F32 again (OUT32, exact)

check-st also re-saves what it loaded with save_file and requires the same tensor layout
(dtype, shape, data_offsets: the reference writer's order) and the same data bytes as FILE.
Exits 1 with a FAIL line on any difference.
"""

import json
import os
import struct
import sys
import tempfile

try:
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import load_file, save_file
except ImportError as e:  # a broken or missing virtual environment must fail, not skip
    print(f"FAIL: {e}: run scripts/setup (it creates .venv with safetensors, numpy, ml_dtypes)")
    sys.exit(1)

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"f32": np.dtype(np.float32), "f64": np.dtype(np.float64),
          "f16": np.dtype(np.float16), "bf16": BF16}


def reference():
    """Tensors with values exact in every dtype (multiples of 1/4 below 16)."""
    def vals(shape, salt, dtype):
        n = int(np.prod(shape))
        v = (np.arange(n, dtype=np.float64) * 7 + salt * 13) % 41 * 0.25 - 5.0
        return v.reshape(shape).astype(dtype)
    return {
        "layers.0.weight": vals((6, 4), 1, np.float32),
        "layers.0.bias": vals((6,), 2, np.float32),
        "layers.1.weight": vals((5, 6), 3, np.float64),
        "norm.scale": vals((7,), 4, np.float16),
        "embed": vals((9, 3), 5, BF16),
    }


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
        data = f.read()
    h.pop("__metadata__", None)
    return h, data, n


def compare(got, want, where):
    if sorted(got) != sorted(want):
        fail(f"{where}: tensors {sorted(got)}, expected {sorted(want)}")
    for name, w in want.items():
        g = got[name]
        if g.dtype != w.dtype or g.shape != w.shape:
            fail(f"{where}: tensor '{name}' is {g.dtype} {g.shape}, expected {w.dtype} {w.shape}")
        if g.tobytes() != w.tobytes():
            fail(f"{where}: tensor '{name}' values differ: {g.ravel()[:8]} vs {w.ravel()[:8]}")


def read_checkpoint(step_dir, states=False):
    """The parameters (or optimizer states) of a fullshard checkpoint, from their shards."""
    with open(os.path.join(step_dir, "index.json")) as f:
        index = json.load(f)
    if index.get("format") != "fullshard-checkpoint":
        fail(f"{step_dir}: not a fullshard checkpoint index")
    files = [os.path.join(step_dir, x["name"]) for x in index["files"]]
    out = {}
    for t in index["tensors"]:
        if bool(t["state"]) != states:
            continue
        dt = DTYPES[t["dtype"]]
        full = np.zeros(t["global_shape"], dtype=dt)
        for s in t["shards"]:
            with open(files[s["file"]], "rb") as f:
                f.seek(s["offset"])
                raw = f.read(s["length"])
            box = tuple(slice(o, o + n) for o, n in zip(s["global_offset"], s["shape"]))
            full[box] = np.frombuffer(raw, dtype=dt).reshape(s["shape"])
        out[t["name"]] = full
    return out


def check_layout(path, tensors):
    """FILE's layout and data equal what the reference writer makes of the same tensors."""
    with tempfile.TemporaryDirectory() as d:
        ref = os.path.join(d, "ref.safetensors")
        save_file(tensors, ref)
        h_ours, data_ours, n = header(path)
        h_ref, data_ref, _ = header(ref)
    if h_ours != h_ref:
        fail(f"{path}: the tensor entries differ from the reference writer's:\n"
             f"  ours {json.dumps(h_ours, sort_keys=True)}\n  ref  {json.dumps(h_ref, sort_keys=True)}")
    if data_ours != data_ref:
        fail(f"{path}: the data bytes differ from the reference writer's")
    if (8 + n) % 8:
        fail(f"{path}: the header length {n} is not padded to a multiple of 8")


def main(argv):
    if len(argv) >= 2 and argv[0] == "write":
        save_file(reference(), argv[1], metadata={"source": "python", "format": "pt"})
        print(f"wrote {argv[1]} with safetensors.numpy.save_file")
    elif len(argv) >= 3 and argv[0] == "check-st":
        got = load_file(argv[1])
        if argv[2] == "--gen":
            want = reference()
        else:
            want = read_checkpoint(argv[3], states=argv[2] == "--ckpt-states")
            if not want:
                fail(f"{argv[3]}: no tensors to compare with")
        compare(got, want, argv[1])
        check_layout(argv[1], got)
        print(f"ok: {argv[1]}: {len(got)} tensors equal the reference, "
              f"laid out like safetensors.numpy.save_file")
    elif len(argv) >= 4 and argv[0] == "to-bf16":
        t = load_file(argv[1])
        b16 = {k: v.astype(BF16) for k, v in t.items()}
        save_file(b16, argv[2])
        save_file({k: v.astype(np.float32) for k, v in b16.items()}, argv[3])
        print(f"wrote {argv[2]} (BF16) and {argv[3]} (the same values in F32)")
    elif len(argv) >= 2 and argv[0] == "check-ckpt":
        compare(read_checkpoint(argv[1]), reference(), argv[1])
        print(f"ok: {argv[1]}: the checkpoint holds the reference tensors")
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
