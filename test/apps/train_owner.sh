#!/usr/bin/env bash
# Nothing a user owns is lost to another run (checkpoint::DirectoryClaim), through
# fullshard-train: a fresh run on a directory holding an earlier run's checkpoints is refused
# (exit 2, before any step); --start-over runs beside them and --keep-last deletes only its
# own; a second job on a directory a running job owns is refused naming the owner, and the
# first job's saves complete; a lock of this Slurm job (a requeue) is taken over; fullshard-ckpt
# refuses to write into a checkpoint directory. Every checkpoint the runs kept still verifies.
#   train_owner.sh MPIEXEC TRAIN CKPT
set -euo pipefail
mpiexec="$1" train="$2" ckpt="$3"
flags=(--layers 2 --hidden 32 --inputs 8 --outputs 4 --batch 16 --seed 5)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/train_run.sh"
ck="$work/ckpt"
fail() { echo "FAIL: $*"; exit 1; }
steps() { (cd "$ck" && ls -d step-* 2>/dev/null | tr '\n' ' ' | sed 's/ $//'); }
refused() {  # refused OUT WANT [flags...]: exit 2 naming WANT, no step run
  local out="$1" want="$2"
  shift 2
  if "$mpiexec" -n 2 "$train" "${flags[@]}" "$@" >"$out.log" 2>&1; then
    cat "$out.log"; fail "$*: exited 0"
  fi
  grep -qF -- "$want" "$out.log" || { cat "$out.log"; fail "$*: no '$want'"; }
  ! grep -q "^step " "$out.log" || { cat "$out.log"; fail "$*: steps ran before the refusal"; }
  echo "ok: refused: $(grep -m1 -oF -- "$want" "$out.log")"
}
verify_all() {
  local d
  for d in "$ck"/step-*; do "$ckpt" verify "$d" >/dev/null || fail "$d does not verify"; done
}

run 2 "$work/a" --steps 4 --save-every 2 --keep-last 1 --checkpoint-dir "$ck"
[[ "$(steps)" == "step-00000004" ]] || fail "run a kept '$(steps)'"

# 1. A fresh run on it, without --resume: refused, the earlier checkpoints untouched.
refused "$work/b" "holds the checkpoints of an earlier run (latest: step-00000004)" \
  --steps 4 --save-every 2 --keep-last 2 --checkpoint-dir "$ck"
grep -qF -- "--start-over starts a new run beside them" "$work/b.log" || fail "no --start-over hint"
[[ "$(steps)" == "step-00000004" && "$(cat "$ck/latest")" == "step-00000004" ]] || fail "touched"

# 2. --start-over: a new run beside them; --keep-last 1 deletes only its own older steps.
run 2 "$work/c" --steps 6 --save-every 2 --keep-last 1 --checkpoint-dir "$ck" --start-over
[[ "$(steps)" == "step-00000004 step-00000006" ]] || fail "start over kept '$(steps)'"
[[ "$(cat "$ck/latest")" == "step-00000006" ]] || fail "latest is not the new run's"
verify_all
echo "ok: --start-over beside an earlier run: its step-00000004 kept, this run's newest only"

# 3. A second job while the first runs (saving asynchronously; a larger model, so that it
# runs for seconds): refused naming the owner; the first job ends with its checkpoints.
ck2="$work/ckpt2"
big=(--hidden 512 --batch 512 --steps 600 --log-every 10 --save-every 200 --async-save)
"$mpiexec" -n 2 "$train" "${flags[@]}" "${big[@]}" --checkpoint-dir "$ck2" >"$work/long.log" 2>&1 &
long=$!
for _ in $(seq 600); do grep -q "^step 10 " "$work/long.log" && break; sleep 0.05; done
grep -q "^step 10 " "$work/long.log" || { kill $long; cat "$work/long.log"; fail "the first job did not start"; }
refused "$work/second" "checkpoint directory '$ck2' is in use by another run, run " "${big[@]}" \
  --checkpoint-dir "$ck2" --start-over
wait $long || { cat "$work/long.log"; fail "the first job failed"; }
grep -q "^step 600 " "$work/long.log" || fail "the first job did not finish"
[[ "$(cat "$ck2/latest")" == "step-00000600" ]] || fail "latest is not the first job's last save"
for d in "$ck2"/step-*; do "$ckpt" verify "$d" >/dev/null || fail "$d does not verify"; done
echo "ok: a second job on a running job's directory refused; the first job's saves complete"

# 4. A requeue: the lock of this Slurm job, left on another host, is taken over.
printf '{"run": "0123456789abcdef", "job": "4242", "host": "elsewhere", "pid": 7, "heartbeat_s": 30}\n' \
  >"$ck/.fullshard-lock"
refused "$work/other-job" "is in use by another run, run 0123456789abcdef (Slurm job 4242" \
  --steps 7 --resume "$ck" --checkpoint-dir "$ck"
SLURM_JOB_ID=4242 run 2 "$work/requeued" --steps 7 --resume "$ck" --checkpoint-dir "$ck"
grep -q "took over the lock of run 0123456789abcdef.*it names this Slurm job (4242)" \
  "$work/requeued.log" || { cat "$work/requeued.log"; fail "no takeover line"; }
[[ ! -e "$ck/.fullshard-lock" ]] || fail "the requeued run left its lock"
echo "ok: a requeued job (the same SLURM_JOB_ID) takes over its lock"

# 5. fullshard-ckpt never writes into a checkpoint directory.
for out in "$ck/latest" "$ck/step-00000007/x.safetensors"; do
  if "$ckpt" convert "$ck" "$out" --to safetensors >"$work/conv.log" 2>&1; then fail "convert wrote $out"; fi
  grep -qF "is in the checkpoint directory" "$work/conv.log" || { cat "$work/conv.log"; fail "convert $out"; }
done
if "$ckpt" convert "$ck" "$ck" --to full >"$work/conv.log" 2>&1; then fail "convert into the root"; fi
[[ "$(cat "$ck/latest")" == "step-00000007" ]] || fail "latest changed"
verify_all
echo "ok: fullshard-ckpt convert refuses outputs in a checkpoint directory"
echo "pass: a run owns its checkpoint directory"
