#!/usr/bin/env python3
"""PyTorch FSDP2 twin of fullshard-train-gpt, for step-by-step comparisons and timings.

`fullshard-train-gpt` (apps/fullshard-train-gpt) trains fullshard::torch::Gpt, a byte-level
GPT-style decoder written with LibTorch, with fullshard's fully_shard on every block and on the
root. This script holds the same model in Python (`GPT` below: the same modules, parameter
names (FQNs), shapes and forward as lib/torch/models/gpt.cpp) and trains it with PyTorch's own
FSDP2 (`torch.distributed.fsdp.fully_shard`, gloo, CPU) with the same optimizer, learning-rate
schedule, gradient clipping and step order as the C++ program. Given the same initial weights
and the same batches (files that both programs read: --init-from and --batches), the two runs
should print the same loss at every step and end at the same weights, up to float rounding.

Subcommands:

  make-batches  Writes the training batches as one raw file: little-endian int64 tokens of shape
                [steps][batch][context + 1] (no header), the format of fullshard-train-gpt's
                --batches. The text is built as the C++ program builds its training corpus:
                every regular file of --data (symbolic links followed), sorted by name, each
                distinct non-empty text once, without the licence families named by --val (a
                family is the file name before the first '-'), concatenated as bytes. The
                windows start at offsets drawn uniformly from [0, len - (context + 1)] with
                numpy.random.default_rng(--seed).

  init          Builds the model with GPT-2's initialisation (N(0, 0.02) for the embeddings and
                the weight matrices, N(0, 0.02 / sqrt(2 * layers)) for the residual projections
                `.proj.` and `.out.`, zero biases, LayerNorm weights 1) from torch.manual_seed
                (--seed) and writes its state_dict as a safetensors file (fullshard-train-gpt's
                --init-from).

  train         Trains from --init-from on --batches. Under torchrun (R ranks; gloo on the CPU,
                or NCCL with --device cuda, one GPU per rank):
                fully_shard on every block, then on the root (default options), rank r taking
                rows [r*B/R, (r+1)*B/R) of each global batch of B sequences. Without torchrun it
                runs as one rank (still fully_shard'ed); with --no-shard it trains the plain
                module on the whole global batch in one process (a reference without FSDP).
                AdamW as the C++ program: betas (0.9, 0.95), eps 1e-8, weight decay on the
                block weight matrices only ("blocks.*.weight" except LayerNorms), learning rate
                warm-up then cosine decay to lr/10, clip_grad_norm_ before every step (--clip 0:
                off). Prints `step <i> loss <mean over ranks> step_ms <ms>` per step (rank 0),
                writes --losses (JSON: losses, step_ms, peak_rss_mib per rank) and --save-to
                (the final full weights as safetensors, the FQNs as names).

  compare       Compares two runs: per-step losses (from --losses JSON files or, with --log-a /
                --log-b, from fullshard-train-gpt's stdout) within a relative tolerance
                |a - b| / |b|, and per tensor of two safetensors files max|a - b| / max|b|.
                Prints the tables and the worst cases; exits 1 out of tolerance, 2 when the
                inputs do not match (different step counts, names or shapes). The key third of
                each qkv.bias is shown on its own row and not judged (--judge-key-bias judges
                it): the softmax is invariant to it, so its gradient is zero in exact arithmetic
                and after training it holds AdamW-normalised rounding noise (about 1e-6).

A side-by-side run (see bench/torch/README.md):

  py=/root/.cache/torch-wheel-venv/bin/python
  $py bench/torch/gpt_fsdp2.py make-batches --out b.bin --steps 10 --batch 8 --context 64
  $py bench/torch/gpt_fsdp2.py init --out w0.safetensors --d-model 64 --layers 2 --heads 4 \\
      --context 64
  mpirun -n 2 fullshard-train-gpt --init-from w0.safetensors --batches b.bin --steps 10 \\
      --batch 8 --context 64 --d-model 64 --layers 2 --heads 4 --save-to cpp.safetensors \\
      > cpp.log
  OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 bench/torch/gpt_fsdp2.py train \\
      --init-from w0.safetensors --batches b.bin --steps 10 --batch 8 --context 64 \\
      --d-model 64 --layers 2 --heads 4 --save-to py.safetensors --losses py.json
  $py bench/torch/gpt_fsdp2.py compare --log-a cpp.log --losses-b py.json \\
      --weights-a cpp.safetensors --weights-b py.safetensors
"""

import argparse
import json
import math
import os
import re
import resource
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def load_file(path):
    """safetensors.torch.load_file, imported on use (the model class needs only torch)."""
    from safetensors.torch import load_file as load

    return load(path)


def save_file(tensors, path):
    """safetensors.torch.save_file, imported on use."""
    from safetensors.torch import save_file as save

    save(tensors, path)


VOCAB = 256  # byte-level, as fst::GptConfig's default


# ---- the model ---------------------------------------------------------------------------------


class Block(nn.Module):
    """One pre-LayerNorm decoder block (fst::GptBlockImpl): x + attn(ln1(x)), + mlp(ln2(.)).

    The submodules are created in the C++ order (ln1, qkv, proj, ln2, fc, out), which fixes the
    order of the parameters and their names.
    """

    def __init__(self, d_model, heads, mlp_ratio=4):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, mlp_ratio * d_model)
        self.out = nn.Linear(mlp_ratio * d_model, d_model)

    def forward(self, x):
        """x: (batch, time, d_model) -> the same shape."""
        b, t, d = x.shape
        hd = d // self.heads
        q, k, v = (
            p.transpose(1, 2) for p in self.qkv(self.ln1(x)).view(b, t, 3, self.heads, hd).unbind(2)
        )
        att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = torch.softmax(att.masked_fill(future, float("-inf")), -1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(b, t, d)
        h = x + self.proj(y)
        return h + self.out(F.gelu(self.fc(self.ln2(h))))


class GPT(nn.Module):
    """fst::GptImpl: token and position embeddings, the blocks, a final LayerNorm and an output
    head tied to the token embedding (no parameter of its own). Dropout 0."""

    def __init__(self, d_model, layers, heads, context, vocab=VOCAB):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"heads ({heads}) must divide d_model ({d_model})")
        self.context = context
        self.vocab = vocab
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)

    def gpt2_init(self, layers):
        """GPT-2's initialisation, in the C++ constructor's order (named_parameters())."""
        with torch.no_grad():
            for name, w in self.named_parameters():
                if name.endswith("bias"):
                    w.zero_()
                elif w.dim() >= 2:
                    residual = ".proj." in name or ".out." in name
                    w.normal_(0.0, 0.02 / math.sqrt(2.0 * layers) if residual else 0.02)

    def forward(self, ids):
        """ids: (batch, time) int64, time <= context -> logits (batch, time, vocab)."""
        t = ids.size(1)
        if t > self.context:
            raise ValueError(f"a sequence of {t} tokens is longer than the context {self.context}")
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        for b in self.blocks:
            x = b(x)
        return torch.matmul(self.ln_f(x), self.tok.weight.t())

    def loss(self, ids):
        """Mean cross-entropy of ids[:, 1:] given ids[:, :-1] (nats per byte). Goes through
        __call__, so that FSDP2's hooks of the root run."""
        logits = self(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, self.vocab), ids[:, 1:].reshape(-1))


def build_model(args):
    return GPT(args.d_model, args.layers, args.heads, args.context)


# ---- make-batches ------------------------------------------------------------------------------


def training_text(data, val):
    """The training bytes of fullshard-train-gpt's corpus (read_corpus in its main.cpp)."""
    if not os.path.isdir(data):
        raise SystemExit(f"--data {data}: not a directory")
    seen, families, parts, names = set(), set(), [], []
    for name in sorted(os.listdir(data)):
        path = os.path.join(data, name)
        if not os.path.isfile(path):  # regular files, links followed
            continue
        with open(path, "rb") as f:
            text = f.read()
        if not text or text in seen:  # a link (or a copy) of a text read already
            continue
        seen.add(text)
        family = name.split("-", 1)[0]
        families.add(family)
        if family not in val:
            parts.append(text)
            names.append(name)
    missing = sorted(val - families)
    if missing:
        raise SystemExit(f"--val: no licence family {', '.join(missing)} in {data}")
    return b"".join(parts), names


def cmd_make_batches(args):
    val = {v for v in args.val.split(",") if v}
    text, names = training_text(args.data, val)
    length = args.context + 1
    if len(text) < length:
        raise SystemExit(f"the training text ({len(text)} bytes) is shorter than context + 1")
    rng = np.random.default_rng(args.seed)
    starts = rng.integers(0, len(text) - length, size=args.steps * args.batch, endpoint=True)
    all_bytes = np.frombuffer(text, dtype=np.uint8)
    windows = all_bytes[starts[:, None] + np.arange(length)[None, :]].astype("<i8")
    windows.reshape(args.steps, args.batch, length).tofile(args.out)
    print(
        f"make-batches: {args.out}: {args.steps} steps x {args.batch} sequences x {length} "
        f"tokens from {len(text)} training bytes ({len(names)} texts, held out: "
        f"{','.join(sorted(val))})"
    )


# ---- init --------------------------------------------------------------------------------------


def cmd_init(args):
    torch.manual_seed(args.seed)
    model = build_model(args)
    model.gpt2_init(args.layers)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, args.out)
    n = sum(v.numel() for v in state.values())
    print(f"init: {args.out}: {len(state)} tensors, {n} parameters")


# ---- train -------------------------------------------------------------------------------------


def lr_at(step, base, warmup, steps):
    """fullshard::optim::WarmupCosine(base, warmup, steps, base / 10).lr(step), step from 0."""
    low = base / 10
    if step < warmup:
        return base * step / warmup
    if step >= steps:
        return low
    progress = (step - warmup) / (steps - warmup)
    return low + (base - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups(model, weight_decay):
    """AdamW's groups as the C++ program makes them: weight decay on the blocks' weight matrices
    only (not on LayerNorms, biases or the embeddings)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        matrix = name.startswith("blocks.") and ".weight" in name and ".ln" not in name
        (decay if matrix else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def read_batches(args):
    """The --batches file as a (steps, batch, context + 1) int64 tensor, checked as the C++
    program checks it."""
    length = args.context + 1
    expected = args.steps * args.batch * length * 8
    size = os.path.getsize(args.batches)
    if size != expected:
        raise SystemExit(
            f"--batches {args.batches}: expected exactly {expected} bytes ({args.steps} steps x "
            f"{args.batch} sequences x {length} int64 tokens), found {size}"
        )
    t = torch.from_numpy(np.fromfile(args.batches, dtype="<i8").astype(np.int64))
    if t.min().item() < 0 or t.max().item() >= VOCAB:
        raise SystemExit(f"--batches {args.batches}: tokens outside [0, {VOCAB})")
    return t.view(args.steps, args.batch, length)


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def cmd_train(args):
    on_gpu = args.device == "cuda"
    if on_gpu and not torch.cuda.is_available():
        print("SKIPPED: no CUDA device visible: gpt_fsdp2.py train --device cuda needs a GPU")
        raise SystemExit(77)
    torch.set_num_threads(args.threads)
    warmup = args.steps // 10 if args.warmup is None else args.warmup
    if not 0 <= warmup < args.steps:
        raise SystemExit(f"--warmup ({warmup}) must be in [0, --steps ({args.steps}))")
    distributed = not args.no_shard
    if distributed:
        for key, value in (
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", str(args.master_port)),
        ):
            os.environ.setdefault(key, value)
        dist.init_process_group("nccl" if on_gpu else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise SystemExit("--no-shard runs as one process: not under torchrun with > 1 rank")
        rank, world = 0, 1
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the {world} ranks")
    local = args.batch // world
    first, last = rank * local, (rank + 1) * local  # this rank's rows of a global batch
    if on_gpu:
        # One GPU per rank (LOCAL_RANK of torchrun), as fullshard binds them. float32 products
        # without TF32 (the C++ program keeps LibTorch's default, off too).
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")

    model = build_model(args)
    model.load_state_dict(load_file(args.init_from), strict=True)  # every rank, full weights
    model.to(device)
    batches = read_batches(args)
    if distributed:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(args.device, (world,), mesh_dim_names=("dp",))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(
        param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95), eps=1e-8
    )
    n_params = sum(p.numel() for p in model.parameters())  # full sizes (DTensors report them)
    if rank == 0:
        backend = "nccl" if on_gpu else "gloo"
        mode = "no shard, one process" if args.no_shard else f"FSDP2 on {world} ranks ({backend})"
        print(
            f"gpt_fsdp2: {n_params} parameters, d_model {args.d_model}, {args.layers} blocks x "
            f"{args.heads} heads, context {args.context}; global batch {args.batch}, {mode}, "
            f"{args.threads} threads per rank, {args.device}; torch {torch.__version__}",
            flush=True,
        )

    losses, times = [], []
    for i in range(args.steps):
        if distributed:
            dist.barrier()
        start = time.perf_counter()
        lr = lr_at(i, args.lr, warmup, args.steps)
        for group in opt.param_groups:
            group["lr"] = lr
        ids = batches[i, first:last].to(device)
        opt.zero_grad(set_to_none=True)
        loss = model.loss(ids)
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        mean = torch.tensor([loss.item()], dtype=torch.float64, device=device)
        if distributed:
            dist.all_reduce(mean)
        mean = mean.item() / world
        ms = (time.perf_counter() - start) * 1e3
        losses.append(mean)
        times.append(ms)
        if rank == 0:
            print(f"step {i + 1} loss {mean:.9f} step_ms {ms:.3f}", flush=True)

    rss = torch.tensor([peak_rss_mib()], dtype=torch.float64, device=device)
    if distributed:
        every = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(world)]
        dist.all_gather(every, rss)
        rss_all = [r.item() for r in every]
    else:
        rss_all = [rss.item()]
    if args.save_to:
        if distributed:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state = get_model_state_dict(model, options=options)  # full on rank 0 only
        else:
            state = model.state_dict()
        if rank == 0:
            save_file({k: v.detach().contiguous() for k, v in state.items()}, args.save_to)
        if distributed:
            dist.barrier()
    if rank == 0:
        if args.losses:
            with open(args.losses, "w") as f:
                json.dump({"losses": losses, "step_ms": times, "peak_rss_mib": rss_all}, f)
                f.write("\n")
        later = times[1:] or times
        print(
            f"summary: {args.steps} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, median step "
            f"{statistics.median(later):.2f} ms (steps 2..{args.steps}), max RSS "
            f"{max(rss_all):.1f} MiB",
            flush=True,
        )
    if distributed:
        # Every rank past its last use of the group before any tears it down (gloo aborts a
        # process whose peer closed the connection under it).
        dist.barrier()
        dist.destroy_process_group()


# ---- compare -----------------------------------------------------------------------------------

STEP_LINE = re.compile(r"^step (\d+) loss (\S+) step_ms (\S+)")


def read_run(json_path, log_path, which):
    """(losses, step_ms) of one run, from a --losses JSON or a log of `step` lines."""
    if (json_path is None) == (log_path is None):
        raise SystemExit(f"give exactly one of --losses-{which} and --log-{which}")
    if json_path is not None:
        with open(json_path) as f:
            run = json.load(f)
        return [float(x) for x in run["losses"]], [float(x) for x in run.get("step_ms", [])]
    losses, times = [], []
    with open(log_path) as f:
        for line in f:
            m = STEP_LINE.match(line)
            if m:
                if int(m.group(1)) != len(losses) + 1:
                    raise SystemExit(f"--log-{which} {log_path}: step {m.group(1)} out of order")
                losses.append(float(m.group(2)))
                times.append(float(m.group(3)))
    if not losses:
        raise SystemExit(f"--log-{which} {log_path}: no 'step <i> loss <v> step_ms <t>' lines")
    return losses, times


def tensor_pairs(wa, wb, judge_key_bias):
    """(label, a, b, judged) for every tensor of two state dicts, in float64.

    The key third of a qkv bias gets its own row, not judged unless judge_key_bias: adding a
    constant vector to every key adds q . b_k to all the scores of a query, which the softmax
    ignores, so its gradient is zero in exact arithmetic and what it holds after training is
    AdamW's normalised rounding noise (about 1e-6, against 1e-2 for the rest of the bias), which
    differs between any two summation orders.
    """
    for name in sorted(wa):
        a, b = wa[name].double(), wb[name].double()
        if judge_key_bias or not name.endswith(".qkv.bias") or a.shape != b.shape:
            yield name, a, b, True
            continue
        qa, ka, va = a.chunk(3)
        qb, kb, vb = b.chunk(3)
        yield name + "[q,v]", torch.cat([qa, va]), torch.cat([qb, vb]), True
        yield name + "[k]", ka, kb, False


def cmd_compare(args):
    la, ta = read_run(args.losses_a, args.log_a, "a")
    lb, tb = read_run(args.losses_b, args.log_b, "b")
    if len(la) != len(lb):
        print(f"compare: run a has {len(la)} steps, run b {len(lb)}", file=sys.stderr)
        return 2
    ok = True
    print(f"{'step':>5} {'loss a':>14} {'loss b':>14} {'rel diff':>10}")
    worst_step, worst_loss = 0, -1.0
    for i, (a, b) in enumerate(zip(la, lb)):
        rel = abs(a - b) / abs(b) if b != 0 else abs(a - b)
        if not rel <= worst_loss:  # NaN counts as worst
            worst_step, worst_loss = i + 1, rel
        print(f"{i + 1:>5} {a:>14.9f} {b:>14.9f} {rel:>10.2e}")
    loss_ok = worst_loss <= args.tol
    ok &= loss_ok
    print(
        f"losses: worst relative difference {worst_loss:.3e} at step {worst_step} "
        f"({'ok' if loss_ok else 'OUT OF TOLERANCE'}, tol {args.tol:g})"
    )
    for name, t in (("a", ta), ("b", tb)):
        if len(t) > 1:
            print(f"run {name}: median step {statistics.median(t[1:]):.3f} ms (steps 2..{len(t)})")

    if (args.weights_a is None) != (args.weights_b is None):
        print("compare: give both --weights-a and --weights-b, or neither", file=sys.stderr)
        return 2
    if args.weights_a is not None:
        wa, wb = load_file(args.weights_a), load_file(args.weights_b)
        if set(wa) != set(wb):
            print(
                f"compare: tensor names differ: only in a {sorted(set(wa) - set(wb))}, only in b "
                f"{sorted(set(wb) - set(wa))}",
                file=sys.stderr,
            )
            return 2
        print(f"{'tensor':<30} {'shape':<10} {'max|a-b|':>10} {'max|b|':>10} {'rel':>10}")
        worst_name, worst_rel = None, -1.0
        for name, a, b, judged in tensor_pairs(wa, wb, args.judge_key_bias):
            if a.shape != b.shape:
                print(
                    f"compare: {name}: shapes {list(a.shape)} and {list(b.shape)}", file=sys.stderr
                )
                return 2
            diff = (a - b).abs().max().item() if a.numel() else 0.0
            scale = b.abs().max().item() if b.numel() else 0.0
            rel = diff / scale if scale > 0 else diff
            if judged and not rel <= worst_rel:
                worst_name, worst_rel = name, rel
            shape = "x".join(str(s) for s in a.shape)
            note = "" if judged else "  (not judged)"
            print(f"{name:<30} {shape:<10} {diff:>10.3e} {scale:>10.3e} {rel:>10.3e}{note}")
        weights_ok = worst_rel <= args.tol
        ok &= weights_ok
        print(
            f"weights: worst max|a-b|/max|b| {worst_rel:.3e} in {worst_name} "
            f"({'ok' if weights_ok else 'OUT OF TOLERANCE'}, tol {args.tol:g})"
        )
    return 0 if ok else 1


# ---- command line ------------------------------------------------------------------------------


def add_model_args(p):
    p.add_argument("--d-model", type=int, default=256, help="model width (default 256)")
    p.add_argument("--layers", type=int, default=4, help="decoder blocks (default 4)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--context", type=int, default=128, help="sequence length (default 128)")


def parser():
    ap = argparse.ArgumentParser(
        description="PyTorch FSDP2 twin of fullshard-train-gpt (same model, weights and data).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="See the module docstring (head of this file) and bench/torch/README.md.",
    )
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-batches", help="write a --batches file from the licence texts")
    p.add_argument("--out", required=True, help="the file to write (raw little-endian int64)")
    p.add_argument("--steps", type=int, required=True, help="steps S")
    p.add_argument("--batch", type=int, required=True, help="global batch B (sequences)")
    p.add_argument("--context", type=int, required=True, help="context T (windows of T + 1)")
    p.add_argument("--seed", type=int, default=1, help="numpy default_rng seed (default 1)")
    p.add_argument(
        "--data", default="/usr/share/common-licenses", help="text directory (default %(default)s)"
    )
    p.add_argument(
        "--val", default="MPL,Apache", help="held-out families, comma-separated (%(default)s)"
    )

    p = sub.add_parser("init", help="write GPT-2-style initial weights as safetensors")
    p.add_argument("--out", required=True, help="the .safetensors file to write")
    add_model_args(p)
    p.add_argument("--seed", type=int, default=1, help="torch.manual_seed (default 1)")

    p = sub.add_parser("train", help="train with FSDP2 (torchrun) or --no-shard")
    p.add_argument("--init-from", required=True, help="initial weights (.safetensors)")
    p.add_argument("--batches", required=True, help="global batches (from make-batches)")
    p.add_argument("--steps", type=int, required=True, help="steps S (as in --batches)")
    p.add_argument("--batch", type=int, required=True, help="global batch B, split over ranks")
    add_model_args(p)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default S/10)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decay (default 0.1)")
    p.add_argument("--clip", type=float, default=1.0, help="max grad norm (default 1; 0: off)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (gloo, default) or cuda (NCCL, one GPU per rank; exit 77 without a GPU)",
    )
    p.add_argument("--save-to", help="write the final full weights here (.safetensors)")
    p.add_argument("--losses", help="write losses, step times and peak RSS here (JSON)")
    p.add_argument(
        "--no-shard", action="store_true", help="plain training in one process (no FSDP)"
    )
    p.add_argument(
        "--master-port",
        type=int,
        default=29531,
        help="rendezvous port without torchrun (default %(default)s; torchrun sets its own)",
    )

    p = sub.add_parser("compare", help="compare two runs' losses and final weights")
    p.add_argument("--losses-a", help="run a: a --losses JSON file")
    p.add_argument("--log-a", help="run a: a log with 'step <i> loss <v> step_ms <t>' lines")
    p.add_argument("--losses-b", help="run b: a --losses JSON file")
    p.add_argument("--log-b", help="run b: a log with 'step' lines")
    p.add_argument("--weights-a", help="run a's final weights (.safetensors)")
    p.add_argument("--weights-b", help="run b's final weights (.safetensors)")
    p.add_argument("--tol", type=float, default=1e-5, help="relative tolerance (default 1e-5)")
    p.add_argument(
        "--judge-key-bias",
        action="store_true",
        help="hold the key third of every qkv.bias to --tol too (by default it is shown, not "
        "judged: its gradient is zero in exact arithmetic, so it holds rounding noise)",
    )
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    if args.command == "make-batches":
        cmd_make_batches(args)
    elif args.command == "init":
        cmd_init(args)
    elif args.command == "train":
        cmd_train(args)
    else:
        return cmd_compare(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
