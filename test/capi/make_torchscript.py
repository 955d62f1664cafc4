#!/usr/bin/env python3
"""Scripts the test models of the C API's TorchScript path and trains them unsharded, as
references (run by CTest with Debian's python3-torch, the PyTorch of its libtorch-dev).

Writes into OUTDIR:
  seq.pt, seq.json          a scripted nn.Sequential of residual blocks (one group each)
  multi.pt, multi.json      a scripted module with two inputs and two outputs (one group)
  mangled.pt, mangled.json  a second scripted nn.Sequential (2 blocks) in the same process:
                            its type name is mangled (___torch_mangle_<n>.Sequential)
  mangled_empty.pt, .json   an empty scripted nn.Sequential, mangled too (must be refused)
  wide.pt                   a scripted nn.Sequential of 4 residual blocks of width 64 (for the
                            creation test's allocation counts; not trained)
  short_record.pt, .json    seq.pt with its first tensor record cut to 4 bytes (LibTorch 1.13
                            would read past it: must be refused before LibTorch reads it)
  <name>.ref                the global batch, targets, losses of 6 AdamW steps and the
                            outputs after them, as text (one value per line)
"""
import io
import json
import sys
import zipfile

import torch
from torch import nn

STEPS, BATCH = 6, 12  # 12 rows: 1, 2, 3 and 4 ranks take equal slices


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Multi(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(3, 6)
        self.head = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))

    def forward(self, x, y):
        h = torch.tanh(self.a(x) + self.b(y))
        return self.head(h), h.sum(1, keepdim=True)


def train(model, inputs, targets):
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        out = model(*inputs)
        out = out if isinstance(out, tuple) else (out,)
        loss = sum(nn.functional.mse_loss(o, t) for o, t in zip(out, targets))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        out = model(*inputs)
    return losses, out if isinstance(out, tuple) else (out,)


def write(outdir, name, model, inputs, targets, config):
    torch.jit.script(model).save(f"{outdir}/{name}.pt")
    config["model"]["file"] = f"{outdir}/{name}.pt"
    with open(f"{outdir}/{name}.json", "w") as f:
        json.dump(config, f)
    losses, outs = train(model, inputs, targets)
    values = []
    for t in list(inputs) + list(targets):
        values += t.flatten().tolist()
    values += losses
    for o in outs:
        values += o.flatten().tolist()
    with open(f"{outdir}/{name}.ref", "w") as f:
        f.write("\n".join(repr(v) for v in values) + "\n")


def main(outdir):
    torch.manual_seed(0)
    opt = {"type": "adamw", "lr": 0.01}
    seq = nn.Sequential(Block(5), Block(5), Block(5))
    x = torch.randn(BATCH, 5)
    write(outdir, "seq", seq, (x,), (torch.sin(x),),
          {"model": {"type": "torchscript"}, "optimizer": opt})
    multi = Multi()
    a, b = torch.randn(BATCH, 4), torch.randn(BATCH, 3)
    write(outdir, "multi", multi, (a, b), (torch.randn(BATCH, 2), torch.randn(BATCH, 1)),
          {"model": {"type": "torchscript"}, "optimizer": opt})
    # Scripted after seq, these Sequentials of other contents get mangled type names.
    mangled = nn.Sequential(Block(5), Block(5))
    write(outdir, "mangled", mangled, (x,), (torch.sin(x),),
          {"model": {"type": "torchscript"}, "optimizer": opt})
    torch.jit.script(nn.Sequential(*[Block(64) for _ in range(4)])).save(f"{outdir}/wide.pt")
    empty = torch.jit.script(nn.Sequential())
    assert "mangle" in empty._c._type().qualified_name(), empty._c._type().qualified_name()
    empty.save(f"{outdir}/mangled_empty.pt")
    with open(f"{outdir}/mangled_empty.json", "w") as f:
        json.dump({"model": {"type": "torchscript", "file": f"{outdir}/mangled_empty.pt"}}, f)
    # seq.pt with the record of its first tensor storage cut short.
    src = zipfile.ZipFile(f"{outdir}/seq.pt")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for info in src.infolist():
            data = src.read(info.filename)
            z.writestr(info.filename, data[:4] if info.filename.endswith("/data/0") else data)
    with open(f"{outdir}/short_record.pt", "wb") as f:
        f.write(buf.getvalue())
    with open(f"{outdir}/short_record.json", "w") as f:
        json.dump({"model": {"type": "torchscript", "file": f"{outdir}/short_record.pt"}}, f)
    print("make_torchscript: wrote seq, multi, mangled, wide, mangled_empty and short_record to", outdir)


if __name__ == "__main__":
    main(sys.argv[1])
