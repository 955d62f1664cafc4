#!/usr/bin/env bash
# fullshard-train --cost/--compute predicts with the plan it executes: on N ranks with fixed
# cost and compute files, the step it prints ("plan X ms", its ops one after the other, and
# "streams overlapped: Y ms") equals what fullshard-plan computes for the graph the run wrote
# (--graph-out: the modules' declared costs and fully_shard requests) with the same cost file
# and options; the module costs are those of the FLOP formula at the fixed rates; and the
# predicted step is that plan time plus the optimizer (elements per rank x ns per element)
# (plus the core wait it prints); with --optimizer-in-backward the updates are the plan's own
# operations and the optimizer term is 0. The memory account fullshard-plan prints is the run's
# planned one, part for part. With module times for the run's shape in the compute file,
# the modules declare those instead, and the run says so. No timing is asserted.
#   train_predict.sh MPIEXEC TRAIN_BINARY PLAN_BINARY RANKS
set -euo pipefail
mpiexec="$1" train="$2" plan="$3" ranks="$4"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cat >"$work/cost.json" <<'JSON'
{"all_gather": {"shard": {"alpha_ms": 0.05, "beta_ms_per_byte": 2e-6}},
 "reduce_scatter": {"shard": {"alpha_ms": 0.07, "beta_ms_per_byte": 3e-6}},
 "copy_gb_per_s": 4}
JSON
cat >"$work/compute.json" <<'JSON'
{"gemm": [{"shape": "16x64x64:NT", "gflop_per_s": 20},
          {"shape": "16x64x64:NN", "gflop_per_s": 16},
          {"shape": "64x64x16:TN", "gflop_per_s": 8}],
 "default_gemm_gflop_per_s": 5, "elementwise_gb_per_s": 2,
 "adamw_ns_per_element": 3, "sgd_ns_per_element": 2, "ranks": 2}
JSON
flags=(--steps 3 --layers 3 --hidden 64 --inputs 16 --outputs 4 --batch 32 --prefetch 1)
"$mpiexec" -n "$ranks" "$train" "${flags[@]}" --cost "$work/cost.json" \
  --compute "$work/compute.json" --graph-out "$work/graph.json" >"$work/train.log" 2>&1 \
  || { echo "FAIL: fullshard-train exited with an error:"; cat "$work/train.log"; exit 1; }
# (fullshard-train's host callbacks assign fresh gradients: no zeroing is planned)
"$plan" --graph "$work/graph.json" --mesh "$ranks" --prefetch 1 --cost "$work/cost.json" \
  --fresh-gradients --optimizer-states 2 >"$work/plan.log" 2>&1 \
  || { echo "FAIL: fullshard-plan exited with an error:"; cat "$work/plan.log"; exit 1; }
grep '^prediction:' "$work/train.log" || true
grep -E '^(serial )?step time:' "$work/plan.log" || true
# The module costs the run declared: a block at 32 / ranks rows (hidden 64) from the rates.
python3 - "$work/graph.json" "$ranks" <<'PY'
import json, sys
g = json.load(open(sys.argv[1]))
r, H = 32 // int(sys.argv[2]), 64
def mod(m, name):
    return next(c for c in m["modules"] if c["name"] == name)
blk = mod(mod(g, "blocks"), "0")
rate = {"NT": 20, "NN": 16, "TN": 8}  # the measured shapes, or the nearest ones
flop = 2.0 * r * H * H
fwd = 2 * flop / (rate["NT"] * 1e6) + 7 * 4 * r * H / 2e6
bwd = 2 * flop / (rate["TN"] * 1e6) + 2 * flop / (rate["NN"] * 1e6) + 6 * 4 * r * H / 2e6
got = blk["cost"]
print("blocks.0 cost", got, "expected", fwd, bwd)
if abs(got["forward_ms"] - fwd) > 1e-9 * fwd or abs(got["backward_ms"] - bwd) > 1e-9 * bwd:
    sys.exit("FAIL: blocks.0's declared cost is not the FLOP formula's")
PY
# compare_prediction FUSED: the run's prediction line against fullshard-plan's step times.
compare_prediction() {
awk -v ranks="$ranks" -v fused="$1" '
  FILENAME ~ /plan.log$/ && /^step time:/ { overlapped = $3 }
  FILENAME ~ /plan.log$/ && /^serial step time:/ { serial = $4 }
  FILENAME ~ /train.log$/ && /^prediction:/ {
    for (i = 1; i <= NF; ++i) {
      if ($i == "step" && $(i + 2) == "ms") predicted = $(i + 1)
      if ($i == "plan") train_serial = $(i + 1)
      if ($i == "overlapped:") train_overlapped = $(i + 1)
      if ($i == "optimizer" && opt == "") opt = $(i + 1)
      if ($i == "wait" && wait == "") wait = $(i + 1)
      if ($(i + 1) == "elements") elements = substr($i, 2)
    }
  }
  END {
    if (serial == "" || train_serial == "") { print "FAIL: no plan or prediction line"; exit 1 }
    d = function_abs(train_serial - serial) + function_abs(train_overlapped - overlapped)
    if (d > 0.0015) { print "FAIL: fullshard-train plan " train_serial " / " train_overlapped \
                      " ms != fullshard-plan " serial " / " overlapped " ms"; exit 1 }
    if (wait == "") { print "FAIL: no core wait in the prediction line"; exit 1 }
    if (function_abs(predicted - train_serial - opt - wait) > 0.0015) {
      print "FAIL: predicted " predicted " != plan " train_serial " + optimizer " opt \
            " + core wait " wait; exit 1 }
    if (fused == 1 && opt != 0) { print "FAIL: optimizer " opt " ms beside a plan that has the updates"; exit 1 }
    if (fused == 0 && function_abs(opt - elements * 3e-6) > 0.0005 + 1e-6 * opt) {
      print "FAIL: optimizer " opt " ms != " elements " elements x 3 ns"; exit 1 }
    print "ok: plan " serial " ms (overlapped " overlapped " ms) in both; optimizer " opt " ms"
  }
  function function_abs(x) { return x < 0 ? -x : x }
' "$work/plan.log" "$work/train.log"
}
compare_prediction 0

# compare_memory: the memory account fullshard-plan prints for the graph (rank 0, bytes) is the
# planned column of the run's memory table (MiB, one decimal) for every library part.
compare_memory() {
python3 - "$work/plan.log" "$work/train.log" <<'PY'
import re, sys
plan = dict(re.findall(r"^  ([a-z ]+?) +[0-9.]+ [KMG]?i?B \(([0-9]+) B\)$", open(sys.argv[1]).read(), re.M))
table = dict(re.findall(r"^  ([a-z ()]+?) +([0-9.]+) +[0-9.]+ +\S+$", open(sys.argv[2]).read(), re.M))
parts = ["shards", "gradients", "optimizer state", "pool", "windows"]
for p in parts:
    if p not in plan or p not in table:
        sys.exit(f"FAIL: no '{p}' in fullshard-plan's memory ({sorted(plan)}) or the run's table ({sorted(table)})")
    mib = int(plan[p]) / 2**20
    if abs(round(mib, 1) - float(table[p])) > 0.051:
        sys.exit(f"FAIL: {p}: fullshard-plan {mib:.4f} MiB, the run planned {table[p]} MiB")
if int(plan["shards"]) <= 0 or int(plan["optimizer state"]) <= 0:
    sys.exit("FAIL: no shards or optimizer state in fullshard-plan's memory")
print("ok: fullshard-plan's memory parts are the run's:", {p: plan[p] for p in parts})
PY
}
compare_memory

# The optimizer inside backward: its updates are the plan's operations.
"$mpiexec" -n "$ranks" "$train" "${flags[@]}" --cost "$work/cost.json" --optimizer-in-backward \
  --compute "$work/compute.json" --graph-out "$work/graph.json" >"$work/train.log" 2>&1 \
  || { echo "FAIL: fullshard-train --optimizer-in-backward exited with an error:"; cat "$work/train.log"; exit 1; }
"$plan" --graph "$work/graph.json" --mesh "$ranks" --prefetch 1 --cost "$work/cost.json" \
  --fresh-gradients --optimizer-in-backward 2 >"$work/plan.log" 2>&1 \
  || { echo "FAIL: fullshard-plan exited with an error:"; cat "$work/plan.log"; exit 1; }
grep -q '^optimizer_in_backward: 2 state arrays' "$work/plan.log" \
  || { echo "FAIL: the plan has no optimizer inside backward"; exit 1; }
compare_prediction 1
compare_memory

# Module times for this shape (rows 32 / ranks per rank, hidden 64, inputs 16, outputs 4):
# the modules declare them, not the FLOP formula's costs.
python3 - "$work/compute.json" "$work/compute_mt.json" "$ranks" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["ranks_per_core"] = 1.0
c["module_times"] = [{"model": "residual_mlp",
                      "shape": {"rows": 32 // int(sys.argv[3]), "hidden": 64, "inputs": 16,
                                "outputs": 4},
                      "modules": {"input": {"forward_ms": 0.25, "backward_ms": 0.125},
                                  "block": {"forward_ms": 1.5, "backward_ms": 2.75},
                                  "output": {"forward_ms": 0.375, "backward_ms": 0.5}}}]
json.dump(c, open(sys.argv[2], "w"))
PY
"$mpiexec" -n "$ranks" "$train" "${flags[@]}" --cost "$work/cost.json" \
  --compute "$work/compute_mt.json" --graph-out "$work/graph_mt.json" >"$work/train_mt.log" 2>&1 \
  || { echo "FAIL: fullshard-train exited with an error:"; cat "$work/train_mt.log"; exit 1; }
grep '^compute:' "$work/train.log" "$work/train_mt.log" || true
grep -q '^compute: the FLOP model at the rates of ' "$work/train.log" \
  || { echo "FAIL: the run without module times does not say it used the FLOP model"; exit 1; }
grep -q '^compute: the measured module times of ' "$work/train_mt.log" \
  || { echo "FAIL: the run with module times does not say it used them"; exit 1; }
python3 - "$work/graph_mt.json" <<'PY'
import json, sys
g = json.load(open(sys.argv[1]))
def mod(m, name):
    return next(c for c in m["modules"] if c["name"] == name)
want = {"input": (0.25, 0.125), "output": (0.375, 0.5)}
want.update({"blocks." + str(i): (1.5, 2.75) for i in range(3)})
for name, (f, b) in want.items():
    m = g
    for part in name.split("."):
        m = mod(m, part)
    got = (m["cost"]["forward_ms"], m["cost"]["backward_ms"])
    if got != (f, b):
        sys.exit(f"FAIL: {name} declared {got}, the measured module times are {(f, b)}")
print("ok: every module declared its measured time")
PY

# The memory account on a model whose parts are megabytes (the table's 0.1 MiB is then < 1 %):
# AdamW after backward, and SGD with momentum.
for opt in "adamw 2" "sgd 1"; do
  read -r name states <<<"$opt"
  "$mpiexec" -n "$ranks" "$train" --steps 2 --layers 3 --hidden 1024 --inputs 16 --outputs 4 \
    --batch 32 --optimizer "$name" --momentum 0.9 --graph-out "$work/graph.json" \
    >"$work/train.log" 2>&1 \
    || { echo "FAIL: fullshard-train --optimizer $name exited with an error:"; cat "$work/train.log"; exit 1; }
  "$plan" --graph "$work/graph.json" --mesh "$ranks" --fresh-gradients \
    --optimizer-states "$states" >"$work/plan.log" 2>&1 \
    || { echo "FAIL: fullshard-plan exited with an error:"; cat "$work/plan.log"; exit 1; }
  compare_memory
done
