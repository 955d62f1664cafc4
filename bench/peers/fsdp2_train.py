#!/usr/bin/env python3
"""PyTorch FSDP2 peer of fullshard-train (not part of CI).

The same model and step as `fullshard-train --layers L --hidden H --batch B`: a residual MLP
(input layer inputs -> H, L blocks h + relu(h W1^T + b1) W2^T + b2, output layer H ->
outputs), MSE onto a fixed random tanh teacher, AdamW (lr 1e-3), the global batch split over
the ranks, `fully_shard` on every block and on the root over a 1-D mesh. Prints the median
step time of steps 2..N (max over ranks), like fullshard-train's summary, and a line
`median_step_ms X` (what scripts/gpu-run reads).

--device cpu (default): a CPU mesh with gloo; the step time is the host's (perf_counter).
--device cuda: `init_device_mesh("cuda")` with NCCL, float32, TF32 off (as fullshard-train
--device cuda: cuBLAS in its default math mode); every step's batch is generated on the host
and copied to the GPU once before the loop (as fullshard-train does); the step time is CUDA
events on the current stream around zero_grad + forward + backward + optimizer step (as
fullshard-train's). Without torchrun it runs as world size 1 (RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT default to 0, 1, 127.0.0.1, 29517).

Setup and run (bench/peers/run-fsdp2 does both):
  python3 -m venv .venv-torch && .venv-torch/bin/pip install torch numpy
  OMP_NUM_THREADS=1 .venv-torch/bin/torchrun --nproc_per_node 2 bench/peers/fsdp2_train.py \
      --layers 8 --hidden 1024 --batch 256 --steps 10
  python3 bench/peers/fsdp2_train.py --device cuda --layers 8 --hidden 2048 --batch 1024
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


def sharded_model(args, device):
    """This rank's place, the fully_shard'ed model (every block, then the root; on "cuda" its
    parameters move to the mesh's GPU), the teacher, AdamW and the rows per rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the {world} ranks")
    mesh = init_device_mesh(device, (world,))
    torch.manual_seed(1)
    if args.init == "meta":  # FSDP2's way for large models: shard on meta, then make the shards
        with torch.device("meta"):
            model = Model(args.inputs, args.hidden, args.layers, args.outputs)
    else:
        model = Model(args.inputs, args.hidden, args.layers, args.outputs)
    teacher = nn.Sequential(nn.Linear(args.inputs, 64), nn.Tanh(), nn.Linear(64, args.outputs))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if args.init == "meta":
        model.to_empty(device=device)
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.reset_parameters()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    return rank, world, model, teacher, opt, args.batch // world


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--inputs", type=int, default=32)
    ap.add_argument("--outputs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--init", choices=("full", "meta"), default="full",
                    help="full: build the model on every rank, then shard (default); meta: "
                    "build on the meta device, shard, then to_empty + reset_parameters")
    args = ap.parse_args()
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (the median is over steps 2..N)")
    if args.device == "cuda":
        return main_cuda(args)

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world, model, teacher, opt, rows = sharded_model(args, "cpu")
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
        print(f"median_step_ms {statistics.median(times):.3f}")
    dist.destroy_process_group()


def main_cuda(args):
    """The same step on GPUs: NCCL, one GPU per rank, f32 without TF32."""
    if not torch.cuda.is_available():
        print("SKIPPED: no CUDA device (torch.cuda.is_available() is False)")
        raise SystemExit(77)
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                 ("MASTER_PORT", "29517")):
        os.environ.setdefault(k, v)
    local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    torch.cuda.set_device(local % torch.cuda.device_count())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    dev = torch.device("cuda", torch.cuda.current_device())
    try:  # device_id (torch >= 2.3) binds the NCCL communicator to the GPU eagerly
        dist.init_process_group("nccl", device_id=dev)
    except TypeError:
        dist.init_process_group("nccl")
    rank, world, model, teacher, opt, rows = sharded_model(args, "cuda")
    xs, ts = [], []
    for step in range(args.steps):  # every batch on the host, copied once
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(args.batch, args.inputs, generator=g)[rank * rows : (rank + 1) * rows]
        with torch.no_grad():
            ts.append(teacher(x))
        xs.append(x)
    xs = torch.stack(xs).to(dev)
    ts = torch.stack(ts).to(dev)
    events = []
    for step in range(args.steps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        opt.zero_grad()
        loss = ((model(xs[step]) - ts[step]) ** 2).sum() / (args.batch * args.outputs)
        loss.backward()
        opt.step()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in events[1:]]
    med = torch.tensor([statistics.median(times)], device=dev)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    last = torch.tensor([loss.item()], device=dev)
    dist.all_reduce(last)
    if rank == 0:
        print(
            f"fsdp2 peer: {world} ranks on cuda ({torch.cuda.get_device_name()}), layers "
            f"{args.layers} hidden {args.hidden} batch {args.batch}: median step "
            f"{med.item():.3f} ms (steps 2..{args.steps}, CUDA events, torch "
            f"{torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
            f"last loss {last.item():.6g})"
        )
        print(f"median_step_ms {med.item():.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
