#!/usr/bin/env python3
"""Writes a transformer-shaped module graph (docs/graph-format.md) with per-module compute
costs from FLOP counts, for fullshard-plan.

Default: the Llama-2-70B shape (80 blocks, hidden 8192, 64 heads with 8 key/value heads,
MLP 28672, vocabulary 32000: 68.98e9 parameters), f32 master weights, 4096 tokens per rank
per step (one sequence of 4096), costed at 989 TFLOP/s (H100 SXM dense bf16) times an MFU
of 0.5. Forward FLOPs of a linear layer: 2 * tokens * in * out; attention scores and the
weighted sum: 2 * 2 * tokens * seq * hidden, halved for a causal mask; backward: twice the
forward.

  python3 docs/examples/gen_transformer.py > docs/examples/transformer_70b.json

The graph asks fully_shard of every block and of the root (FSDP2's recipe); fullshard-plan
--auto --auto-regroup treats those requests as the hand-written default and searches freely.
"""
import argparse
import json
import re
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=28672)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank per step")
    ap.add_argument("--tflops", type=float, default=989.0, help="peak TFLOP/s per GPU")
    ap.add_argument("--mfu", type=float, default=0.5)
    ap.add_argument("--dtype", default="f32")
    ap.add_argument("--no-requests", action="store_true",
                    help="no fully_shard request on the blocks (default: every block + root, "
                         "FSDP2's recipe)")
    a = ap.parse_args()

    rate = a.tflops * 1e12 * a.mfu / 1e3  # FLOP per ms
    d, t = a.hidden, a.tokens
    kv = d // a.heads * a.kv_heads

    def cost(flops):
        fwd = flops / rate
        return {"forward_ms": round(fwd, 6), "backward_ms": round(2 * fwd, 6)}

    def param(*shape):
        return {"shape": list(shape), "dtype": a.dtype}

    def linear_flops(n_in, n_out):
        return 2 * t * n_in * n_out

    attn_flops = (linear_flops(d, d) * 2 + linear_flops(d, kv) * 2
                  + 2 * 2 * t * a.seq * d / 2)
    mlp_flops = linear_flops(d, a.ffn) * 3
    norm_flops = 4 * t * d  # two RMSNorms per block: ~4 FLOP per element
    blocks = []
    for i in range(a.layers):
        block = {
            "name": str(i),
            "params": {"attn_norm": param(d), "ffn_norm": param(d)},
            "cost": cost(norm_flops),
            "modules": [
                {"name": "attn",
                 "params": {"wq": param(d, d), "wk": param(kv, d), "wv": param(kv, d),
                            "wo": param(d, d)},
                 "cost": cost(attn_flops)},
                {"name": "mlp",
                 "params": {"w1": param(a.ffn, d), "w2": param(d, a.ffn),
                            "w3": param(a.ffn, d)},
                 "cost": cost(mlp_flops)},
            ],
        }
        if not a.no_requests:
            block["fully_shard"] = True
        blocks.append(block)
    graph = {
        "name": "transformer",
        "fully_shard": True,
        "modules": [
            {"name": "embed", "params": {"weight": param(a.vocab, d)}, "cost": cost(2 * t * d)},
            {"name": "layers", "modules": blocks},
            {"name": "norm", "params": {"weight": param(d)}, "cost": cost(2 * t * d)},
            {"name": "output", "params": {"weight": param(a.vocab, d)},
             "cost": cost(linear_flops(d, a.vocab))},
        ],
    }
    text = json.dumps(graph, indent=1)
    # Arrays of numbers and small objects on one line each.
    text = re.sub(r"\[\s*([-\d.,\s]+?)\s*\]", lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]", text)
    text = re.sub(r"\{\s*(\"[^{}]*?)\s*\}", lambda m: "{" + " ".join(m.group(1).split()) + "}", text)
    sys.stdout.write(text + "\n")
    n = (a.layers * (2 * d + 2 * d * d + 2 * kv * d + 3 * a.ffn * d) + 2 * a.vocab * d + d)
    print(f"{n} parameters", file=sys.stderr)


if __name__ == "__main__":
    main()
