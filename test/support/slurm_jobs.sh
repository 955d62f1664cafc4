# Sourced by the Slurm test scripts (test/slurm, test/cluster), which set $case: failing with
# the files that explain it, the state of a job and a bounded wait for its end.
show() {  # show FILE...: the files, for a failure message
  local f
  for f in "$@"; do [[ -f "$f" ]] && { echo "--- $f:"; cat "$f"; }; done
  return 0
}
fail() {
  echo "FAIL: $case: $1"
  shift
  show "$@"
  exit 1
}
job_field() { scontrol show job "$1" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$2=//p" | head -1; }
# Waits until job J has ended, at most S seconds; sets $state to its final state.
wait_ended() {  # wait_ended J S OUT
  local j="$1" s="$2" out="$3" t=0 st
  while :; do
    st="$(job_field "$j" JobState)"
    case "$st" in
      COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY | BOOT_FAIL | DEADLINE | PREEMPTED)
        state="$st"
        return 0
        ;;
    esac
    if ((t++ >= s * 5)); then
      scancel "$j" 2>/dev/null || true
      fail "job $j is still '$st' after ${s} s (cancelled); $(scontrol show job "$j" 2>&1 | grep -E 'Reason|RunTime' | tr -s ' ' | tr '\n' ' ')" "$out"
    fi
    sleep 0.2
  done
}
# fullshard-srun (scripts/slurm) runs a step once more when Open MPI 4.1 crashed inside
# MPI_Init under srun (its start-up race, docs/cluster.md) and says so in a line "... retry N:
# ..."; a second crash in a row fails the step, and so the job and the test. Every retry is
# printed and counted here.
retries=0
report_retries() {  # report_retries OUT: prints and counts the retries in a step's or job's output
  local n
  n="$(grep -c "^fullshard-srun\[job [^]]*\]: retry [0-9]*:" "$1" 2>/dev/null || true)"
  n="${n:-0}"
  retries=$((retries + n))
  if ((n > 0)); then
    echo "NOTE: $1: $n retry of a step Open MPI crashed inside MPI_Init (fullshard-srun):"
    grep "^fullshard-srun\[job [^]]*\]: retry" "$1"
  fi
  return 0
}
