#!/usr/bin/env bash
# fullshard-train on 2 ranks, writing what the session test (test/session/test_train_program.cpp)
# compares against: the configuration the program gave the session (--write-config) and the
# losses it printed (one per step). The test's model shape and data are these flags'.
#   train_program_run.sh MPIEXEC PROGRAM OUTDIR OPTIMIZER
set -euo pipefail
mpiexec="$1" program="$2" out="$3" optimizer="$4"
rm -rf "$out" && mkdir -p "$out"
steps=6
"$mpiexec" -n 2 "$program" --layers 2 --hidden 32 --inputs 8 --outputs 4 --batch 18 \
  --steps $steps --seed 3 --optimizer "$optimizer" --lr 0.01 --weight-decay 0.01 --warmup 2 \
  --clip 0.5 --write-config "$out/config.json" | tee "$out/stdout.txt"
awk '/^step [0-9]+ loss/ { print $4 }' "$out/stdout.txt" > "$out/losses.txt"
[[ "$(wc -l < "$out/losses.txt")" -eq $steps ]] || { echo "FAIL: not $steps step lines"; exit 1; }
echo "train program run: $steps steps written to $out"
