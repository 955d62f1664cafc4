#!/usr/bin/env python3
"""PyTorch FSDP2 peer of fullshard-train across the nodes of scripts/cluster-local (not CI).

fsdp2_train.py's model, data, loss, optimizer and timing (its Model class is imported), on
a 1-D mesh (--mesh N: FSDP, like `fullshard-train --mesh N`) or a 2-D DeviceMesh
(--mesh RxS: HSDP, `fully_shard` replicating over R and sharding over S, like
`fullshard-train --mesh RxS`; ranks are numbered node by node, so with --mesh 2x2 on 2 nodes
x 2 ranks the shard groups lie inside a node and the replicate groups cross the link).
Started by mpirun, one process per rank: RANK, WORLD_SIZE and LOCAL_RANK come from Open
MPI's OMPI_COMM_WORLD_* variables when unset; MASTER_ADDR and MASTER_PORT must be set (the
rendezvous of gloo's TCP store); GLOO_SOCKET_IFNAME pins gloo's interface. Prints the median
step time of steps 2..N (max over ranks) and `median_step_ms X`. bench/peers/cluster-bench
runs it; by hand, with the cluster up:
  mpirun $(scripts/cluster-local mpi-args) --host fsnode1:2,fsnode2:2 -n 4 \
    -x MASTER_ADDR=10.213.47.1 -x MASTER_PORT=29531 -x GLOO_SOCKET_IFNAME=eth0 \
    -x OMP_NUM_THREADS=1 .venv-torch/bin/python \
    bench/peers/fsdp2_cluster.py --mesh 2x2 --layers 4 --hidden 512 --batch 256 --steps 30
"""
import argparse
import os
import statistics
import sys
import time

for k, v in (("RANK", "OMPI_COMM_WORLD_RANK"), ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"),
             ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")):
    if k not in os.environ and v in os.environ:
        os.environ[k] = os.environ[v]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp2_train import Model, fully_shard  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mesh", default=None, help="N (FSDP) or RxS (HSDP); default: world")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--inputs", type=int, default=32)
    ap.add_argument("--outputs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh_arg = args.mesh or str(world)
    if "x" in mesh_arg:
        r, s = (int(v) for v in mesh_arg.split("x"))
        shape, names = (r, s), ("replicate", "shard")
    else:
        shape, names = (int(mesh_arg),), ("shard",)
    if (shape[0] * shape[-1] if len(shape) == 2 else shape[0]) != world:
        raise SystemExit(f"--mesh {mesh_arg} does not describe the {world} ranks")
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the {world} ranks")
    rows = args.batch // world
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(1)
    model = Model(args.inputs, args.hidden, args.layers, args.outputs)
    teacher = nn.Sequential(nn.Linear(args.inputs, 64), nn.Tanh(), nn.Linear(64, args.outputs))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
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
    last = torch.tensor([loss.item()])
    dist.all_reduce(last)
    if rank == 0:
        kind = "HSDP" if len(shape) == 2 else "FSDP"
        print(
            f"fsdp2 peer ({kind}, mesh {mesh_arg}, {world} ranks on "
            f"{os.environ.get('FSDP2_NODES', '?')} nodes): layers {args.layers} hidden "
            f"{args.hidden} batch {args.batch}: median step {statistics.median(times):.1f} ms "
            f"(steps 2..{args.steps}, torch {torch.__version__}, gloo), last loss "
            f"{last.item() / world:.6g}"
        )
        print(f"median_step_ms {statistics.median(times):.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
