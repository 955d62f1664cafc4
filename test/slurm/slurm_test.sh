#!/usr/bin/env bash
# Slurm end to end, on the one-node cluster of scripts/slurm-local (the CTest fixture
# slurm.cluster starts it): the job scripts of scripts/slurm/ submitted with sbatch and only
# command-line overrides for one node of 2 cores without GPUs, srun launches of the apps,
# resume across submissions, requeue on the time-limit warning, and a killed rank.
#   slurm_test.sh CASE ROOT MPIEXEC TRAIN HEAT WORKDIR [HEAT_FORTRAN]
# CASE: srun-train srun-heat sbatch-train sbatch-heat resume requeue rank-killed
#       srun-heat-fortran (needs HEAT_FORTRAN)
# Every wait is bounded; a job that does not end in time is cancelled and the case fails with
# the job's state and output.
set -euo pipefail
case="$1" root="$2" mpiexec="$3" train="$4" heat="$5" work="$6" heat_fortran="${7:-}"
export PATH="$(dirname "$train"):$(dirname "$heat"):$PATH"
export OPENBLAS_NUM_THREADS=1 FULLSHARD_TIMEOUT=60
unset TRAIN_CHECKPOINT_DIR TRAIN_SAVE_EVERY TRAIN_MAX_REQUEUES

# The overrides that fit the scripts' GPU-cluster #SBATCH lines onto this node.
node=(-N1 --ntasks-per-node=2 -c1 --gpus-per-node=0)
train_job="$root/scripts/slurm/fullshard-train.sbatch"
heat_job="$root/scripts/slurm/heat-surrogate.sbatch"
small=(--layers 2 --hidden 32 --inputs 16 --outputs 4 --batch 32 --seed 3)
heat_small=(--nx 96 --ny 96 --steps 600 --interval 4 --radius 2 --samples 256 --eval-points 256
            --hidden 64 --blocks 2 --batch 128 --report-every 50)
dir="$work/$case"
rm -rf "$dir"
mkdir -p "$dir"
cd "$dir"

jobs_started=()
cleanup() {  # a failed case leaves no job behind
  local j
  for j in ${jobs_started[@]+"${jobs_started[@]}"}; do scancel "$j" 2>/dev/null || true; done
}
trap cleanup EXIT

source "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/support/slurm_jobs.sh"  # show, fail, job_field, wait_ended

submit() {  # submit SBATCH-ARGS...: sets $job to the job id
  job="$(sbatch --parsable --chdir "$dir" "$@")" || fail "sbatch $* was refused"
  job="${job%%;*}"
  jobs_started+=("$job")
}
# Waits until FILE has a line matching the ERE, at most S seconds (and while job J lives).
wait_line() {  # wait_line J FILE ERE S
  local j="$1" f="$2" re="$3" s="$4" t=0
  until grep -qE "$re" "$f" 2>/dev/null; do
    ((t++ < s * 5)) || fail "no line matching '$re' in $f within ${s} s (job $j: $(job_field "$j" JobState))" "$f"
    sleep 0.2
  done
}
expect_state() {  # expect_state J WANT OUT
  wait_ended "$1" 90 "$3"
  report_retries "$3"
  [[ "$state" == "$2" ]] || fail "job $1 ended $state (exit code $(job_field "$1" ExitCode)), expected $2" "$3"
  echo "job $1: $state (exit code $(job_field "$1" ExitCode))"
}
losses() { awk '$1 == "step" && $3 == "loss" { print $2, $4 }' "$@"; }
# A reference run of fullshard-train on 2 ranks under mpiexec (not Slurm).
reference() {  # reference OUT FLAGS...
  local out="$1"
  shift
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
    timeout 60 "$mpiexec" -n 2 "$train" "$@" >"$out.log" 2>&1 || fail "mpiexec -n 2 fullshard-train $* failed" "$out.log"
  losses "$out.log" >"$out"
}
same_losses() {  # same_losses WHAT REF GOT LOG: identical step/loss lines
  cmp -s "$2" "$3" || { echo "FAIL: $case: $1: step losses differ (reference | this run):"; paste -d'|' "$2" "$3"; show "$4"; exit 1; }
  echo "ok: $1: $(wc -l <"$3") step losses equal the mpiexec run's"
}
# The rank-1 process of job J's step 0 (scontrol listpids: PID JOBID STEPID LOCALID GLOBALID).
rank_pid() { scontrol listpids "$1" 2>/dev/null | awk '$3 == "0" && $5 == "1" { print $1; exit }'; }

scontrol ping 2>/dev/null | grep -q UP \
  || fail "slurmctld does not answer (scontrol ping); start the cluster with scripts/slurm-local start"

case "$case" in
  srun-train)  # srun with PMIx: 2 ranks in one world, the mpiexec run's losses
    reference ref "${small[@]}" --steps 10
    timeout 60 fullshard-srun -n 2 --mpi=pmix fullshard-train "${small[@]}" --steps 10 >srun.log 2>&1 \
      || fail "srun -n 2 --mpi=pmix fullshard-train exited with status $?" srun.log
    report_retries srun.log
    grep -q "on (shard=2) rank 0" srun.log || fail "the ranks did not form one 2-rank world" srun.log
    losses srun.log >srun
    [[ $(wc -l <srun) -eq 10 ]] || fail "expected 10 step lines" srun.log
    same_losses "srun -n 2 --mpi=pmix fullshard-train" ref srun srun.log
    ;;

  srun-heat)  # srun of the in-situ app: it learns (verdict PASS, exit 0) on 2 ranks
    timeout 90 fullshard-srun -n 2 --mpi=pmix heat-surrogate "${heat_small[@]}" >srun.log 2>&1 \
      || fail "srun -n 2 --mpi=pmix heat-surrogate exited with status $?" srun.log
    report_retries srun.log
    grep -qE "^verdict: PASS: the surrogate beats no-change" srun.log || fail "no PASS verdict" srun.log
    grep -E "^verdict" srun.log
    ;;

  srun-heat-fortran)  # the Fortran in-situ app on 4 tasks of the 2-CPU node (--overcommit)
    [[ -n "$heat_fortran" ]] || fail "no heat-fortran program given"
    timeout 150 fullshard-srun -n 4 --overcommit --mpi=pmix "$heat_fortran" >srun.log 2>&1 \
      || fail "srun -n 4 --overcommit --mpi=pmix heat-fortran exited with status $?" srun.log
    report_retries srun.log
    grep -q "on 4 ranks" srun.log || fail "the 4 tasks did not form one 4-rank world" srun.log
    grep -qE "^verdict: PASS" srun.log || fail "no PASS verdict" srun.log
    grep -E "^verdict" srun.log
    ;;

  sbatch-train)  # the job script as shipped, with overrides: trains, checkpoints, same losses
    reference ref "${small[@]}" --steps 20
    export TRAIN_SAVE_EVERY=10
    submit "${node[@]}" "$train_job" "${small[@]}" --steps 20 --log-every 1
    j="$job"
    out="fullshard-train-$j.out"
    expect_state "$j" COMPLETED "$out"
    grep -q "on (shard=2) rank 0" "$out" || fail "the job's ranks did not form one 2-rank world (mesh 2)" "$out"
    for s in 10 20; do
      grep -q "checkpoint: step $s saved to $dir/fullshard-train-$j.ckpt/" "$out" \
        || fail "no checkpoint at step $s in $dir/fullshard-train-$j.ckpt" "$out"
    done
    losses "$out" >job
    same_losses "sbatch fullshard-train.sbatch" ref job "$out"
    ;;

  sbatch-heat)  # the job script as shipped, with overrides: verdict PASS, job COMPLETED
    submit "${node[@]}" "$heat_job" "${heat_small[@]}"
    j="$job"
    out="heat-surrogate-$j.out"
    expect_state "$j" COMPLETED "$out"
    grep -qE "^verdict: PASS: the surrogate beats no-change" "$out" || fail "no PASS verdict" "$out"
    grep -E "^verdict" "$out"
    ;;

  resume)  # a job that stops at step 20 (checkpoint), a second submission resumes to step 40
    reference ref "${small[@]}" --steps 40
    export TRAIN_CHECKPOINT_DIR="$dir/ckpt" TRAIN_SAVE_EVERY=10
    submit "${node[@]}" "$train_job" "${small[@]}" --steps 40 --stop-after 20 --log-every 1
    j1="$job"
    expect_state "$j1" COMPLETED "fullshard-train-$j1.out"
    grep -q "checkpoint: step 20 saved to $dir/ckpt/" "fullshard-train-$j1.out" \
      || fail "the first job saved no checkpoint at step 20" "fullshard-train-$j1.out"
    submit "${node[@]}" "$train_job" "${small[@]}" --steps 40 --log-every 1
    j2="$job"
    out="fullshard-train-$j2.out"
    expect_state "$j2" COMPLETED "$out"
    grep -q "resumed from $dir/ckpt/step-00000020 at step 20" "$out" \
      || fail "the second job did not resume from step 20" "$out"
    cat <(losses "fullshard-train-$j1.out") <(losses "$out") >job
    same_losses "job $j1 (steps 1-20) + job $j2 (resumed, steps 21-40)" ref job "$out"
    echo "ok: final line: $(grep '^step 40 ' "$out")"
    ;;

  requeue)  # USR1 (Slurm's time-limit warning, --signal=B:USR1@120) requeues; the rerun resumes
    export TRAIN_CHECKPOINT_DIR="$dir/ckpt" TRAIN_SAVE_EVERY=20
    submit "${node[@]}" "$train_job" "${small[@]}" --steps 100000000 --log-every 20
    j="$job"
    out="fullshard-train-$j.out"
    wait_line "$j" "$out" "^checkpoint: step [0-9]+ saved" 60
    # The run holds its checkpoint directory under this job's id (issue 53): the rerun of a
    # requeue is the same job, so it takes the directory back, also from a lock left behind.
    lock="$dir/ckpt/.fullshard-lock"
    grep -Eq "\"job\": ?\"$j\"" "$lock" \
      || fail "the lock of the checkpoint directory does not name job $j: $(cat "$lock" 2>&1)" "$out"
    # What Slurm sends at the time limit minus 120 s, sent now.
    scancel --batch --signal=USR1 "$j" || fail "scancel --batch --signal=USR1 $j failed" "$out"
    wait_line "$j" "$out" "time limit near: requeueing \(requeue 1 of at most 10\)" 30
    t=0
    until [[ "$(job_field "$j" Restarts)" == 1 && "$(job_field "$j" JobState)" == PENDING ]]; do
      ((t++ < 150)) || fail "job $j was not requeued (state $(job_field "$j" JobState), restarts $(job_field "$j" Restarts))" "$out"
      sleep 0.2
    done
    # Slurm holds a requeued job for a while (BeginTime); let it start now, but not in the
    # second the first run was killed: slurmd revokes the job's credential at that second and
    # refuses a credential created in the same second ("Job credential revoked": the job then
    # FAILS instead of running again).
    sleep 1.1
    scontrol update jobid="$j" StartTime=now
    wait_line "$j" "$out" "^resumed from $dir/ckpt/step-[0-9]+ at step [0-9]+" 60
    # The rerun must start from the last checkpoint the first run completed.
    last="$(awk '/^resumed from/ { exit } /^checkpoint: step [0-9]+ saved/ { s = $3 } END { print s }' "$out")"
    at="$(sed -n 's/^resumed from .* at step \([0-9]*\) .*/\1/p' "$out")"
    # (or the one after it, if the kill came between a save's commit and its output line)
    [[ -n "$last" && ("$at" == "$last" || "$at" == $((last + 20))) ]] \
      || fail "the rerun resumed at step '$at', the last checkpoint of the first run is step '$last'" "$out"
    grep -q "run 1 of this job on .* (resuming)" "$out" || fail "no '(resuming)' line for run 1" "$out"
    # The requeue killed the first run, whose lock stayed: the rerun took it over as its own.
    grep -q "took over the lock of run .*(Slurm job $j, .*it names this Slurm job ($j): the job was requeued" "$out" \
      || fail "the rerun did not take over the first run's lock as this job's" "$out"
    grep -Eq "\"job\": ?\"$j\"" "$lock" \
      || fail "the rerun does not hold the checkpoint directory: $(cat "$lock" 2>&1)" "$out"
    echo "ok: requeued on USR1 (restarts 1), the rerun resumed at step $at"
    # The run would go on for 1e8 steps: cancel it; that ends the job, with Slurm's message.
    scancel "$j"
    expect_state "$j" CANCELLED "$out"
    grep -q "\*\*\* JOB $j ON .* CANCELLED AT" "$out" || fail "no cancellation message" "$out"
    ;;

  rank-killed)  # one rank killed: the whole job ends (FAILED) with messages, in bounded time
    submit "${node[@]}" "$train_job" "${small[@]}" --steps 100000000 --log-every 50
    j="$job"
    out="fullshard-train-$j.out"
    wait_line "$j" "$out" "^step [0-9]+ loss" 60
    pid="$(rank_pid "$j")"
    [[ -n "$pid" ]] || fail "scontrol listpids $j shows no rank 1 of step 0: $(scontrol listpids "$j" 2>&1)" "$out"
    kill -KILL "$pid"
    SECONDS=0
    expect_state "$j" FAILED "$out"
    echo "ok: the job ended $SECONDS s after rank 1 was killed"
    grep -q "srun: error: .*: task 1: Killed" "$out" || fail "no 'task 1: Killed' message" "$out"
    grep -q "srun fullshard-train ended with status [1-9][0-9]*: the job ends here" "$out" \
      || fail "no message from the job script" "$out"
    grep -E "task 1: Killed|ended with status" "$out"
    ;;

  *)
    echo "slurm_test.sh: unknown case '$case'" >&2
    exit 2
    ;;
esac
echo "slurm $case: ok (retries of Open MPI's start-up crash: $retries)"
