#!/usr/bin/env bash
# fullshard-train-gpt on 2 ranks with its batches from a file, writing what the session test
# (test/session/test_gpt_program.cpp) compares against: the configuration the program gave the
# session (--write-config), the batches, and the losses it printed (one per step).
#   gpt_program_run.sh MPIEXEC PROGRAM OUTDIR
set -euo pipefail
mpiexec="$1" program="$2" out="$3"
rm -rf "$out" && mkdir -p "$out"
steps=6 batch=8 context=16
# Random tokens in [0, 256): [steps][batch][context + 1] little-endian int64.
python3 - "$out/batches.bin" $steps $batch $context <<'PY'
import random, struct, sys
path, steps, batch, context = sys.argv[1], *map(int, sys.argv[2:])
rng = random.Random(11)
n = steps * batch * (context + 1)
open(path, "wb").write(struct.pack("<%dq" % n, *(rng.randrange(256) for _ in range(n))))
PY
"$mpiexec" -n 2 "$program" --steps $steps --batch $batch --context $context --d-model 32 \
  --layers 2 --heads 2 --dropout 0.1 --lr 0.01 --warmup 2 --weight-decay 0.1 --clip 0.5 \
  --seed 5 --eval-every 0 --eval-windows 8 --batches "$out/batches.bin" \
  --write-config "$out/config.json" | tee "$out/stdout.txt"
awk '/^step [0-9]+ loss/ { print $4 }' "$out/stdout.txt" > "$out/losses.txt"
[[ "$(wc -l < "$out/losses.txt")" -eq $steps ]] || { echo "FAIL: not $steps step lines"; exit 1; }
echo "gpt program run: $steps steps written to $out"
