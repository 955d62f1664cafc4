#!/usr/bin/env python3
"""PyTorch FSDP2 peer of fullshard-train (not part of CI).

The same model and step as `fullshard-train --layers L --hidden H --batch B`: a residual MLP
(input layer inputs -> H, L blocks h + relu(h W1^T + b1) W2^T + b2, output layer H ->
outputs), MSE onto a fixed random tanh teacher, AdamW (lr 1e-3), the global batch split over
the ranks, `fully_shard` on every block and on the root over a 1-D CPU mesh with gloo. Prints
the median step time of steps 2..N (max over ranks), like fullshard-train's summary.

Setup and run (bench/peers/run-fsdp2 does both):
  python3 -m venv .venv-torch && .venv-torch/bin/pip install torch numpy
  OMP_NUM_THREADS=1 .venv-torch/bin/torchrun --nproc_per_node 2 bench/peers/fsdp2_train.py \
      --layers 8 --hidden 1024 --batch 256 --steps 10
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

try:  # torch >= 2.6
    from torch.distributed.fsdp import fully_shard
except ImportError:  # 2.4 / 2.5
    from torch.distributed._composable.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh


class Block(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.l1 = nn.Linear(h, h)
        self.l2 = nn.Linear(h, h)

    def forward(self, x):
        return x + self.l2(torch.relu(self.l1(x)))


class Model(nn.Module):
    def __init__(self, inputs, hidden, layers, outputs):
        super().__init__()
        self.inp = nn.Linear(inputs, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.out = nn.Linear(hidden, outputs)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--inputs", type=int, default=32)
    ap.add_argument("--outputs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the {world} ranks")
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(1)
    model = Model(args.inputs, args.hidden, args.layers, args.outputs)
    teacher = nn.Sequential(nn.Linear(args.inputs, 64), nn.Tanh(), nn.Linear(64, args.outputs))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    rows = args.batch // world
    times = []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(args.batch, args.inputs, generator=g)[rank * rows : (rank + 1) * rows]
        with torch.no_grad():
            t = teacher(x)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = ((model(x) - t) ** 2).sum() / (args.batch * args.outputs)
        loss.backward()
        opt.step()
        dt = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if step > 0:
            times.append(dt.item() * 1e3)
    if rank == 0:
        print(
            f"fsdp2 peer: {world} ranks, layers {args.layers} hidden {args.hidden} batch "
            f"{args.batch}: median step {statistics.median(times):.1f} ms "
            f"(steps 2..{args.steps}, torch {torch.__version__}, gloo)"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
