#!/usr/bin/env bash
# heat-surrogate never hangs on a stopped rank or on ranks given different options:
#   heat_bounded.sh MPIEXEC HEAT stopped TRAIN_RANKS STOP_RANK
#       3 ranks; once the run is under way, rank STOP_RANK is stopped (SIGSTOP). The others
#       must end the job with the library's timeout message (FULLSHARD_TIMEOUT=3) within 40 s.
#   heat_bounded.sh MPIEXEC HEAT mismatch
#       2 ranks (MPMD) with different --steps, then different --train-ranks, then a refused
#       option on one rank: each must exit 2 with the reason printed on every rank.
# Everything this script starts is continued and killed (by pid) before it exits.
set -uo pipefail
mpiexec="$1" heat="$2" mode="$3"
small=(--nx 40 --ny 40 --samples 64 --eval-points 32 --batch 32 --hidden 16 --blocks 1)
work="$(mktemp -d)"
launcher=""

descendants() {  # every process below pid $1
  local c
  for c in $(pgrep -P "$1" 2>/dev/null); do
    echo "$c"
    descendants "$c"
  done
}
cleanup() {
  if [[ -n "$launcher" ]] && kill -0 "$launcher" 2>/dev/null; then
    local pids
    pids="$(descendants "$launcher")"
    for p in $pids; do kill -CONT "$p" 2>/dev/null; done
    kill -KILL "$launcher" $pids 2>/dev/null
    wait "$launcher" 2>/dev/null
  fi
  rm -rf "$work"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  echo "--- output:"
  cat "$work/out" 2>/dev/null
  exit 1
}

export FULLSHARD_TIMEOUT=3 OPENBLAS_NUM_THREADS=1

if [[ "$mode" == stopped ]]; then
  train_ranks="$4" stop_rank="$5"
  # Mostly solver steps (halo exchanges, the waits the library does not see): 200 per round
  # against one small optimizer step.
  "$mpiexec" -n 3 "$heat" "${small[@]}" --interval 200 --steps 200000000 --report-every 1000000 \
    --hidden 8 --blocks 0 --train-ranks "$train_ranks" >"$work/out" 2>&1 &
  launcher=$!
  # Under way: rank 0 printed the progress line of round 1 (every rank has trained once).
  for ((i = 0; i < 300; ++i)); do
    grep -q "^step 200 " "$work/out" && break
    kill -0 "$launcher" 2>/dev/null || fail "the run ended before it was under way"
    sleep 0.1
  done
  grep -q "^step 200 " "$work/out" || fail "no progress line within 30 s"
  sleep 0.5
  victim=""
  for p in $(descendants "$launcher"); do
    if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$stop_rank"; then
      victim="$p"
      break
    fi
  done
  [[ -n "$victim" ]] || fail "cannot find the process of rank $stop_rank"
  kill -STOP "$victim"
  echo "stopped rank $stop_rank (pid $victim) of 3 (--train-ranks $train_ranks)"
  for ((i = 0; i < 400; ++i)); do
    kill -0 "$launcher" 2>/dev/null || break
    sleep 0.1
  done
  kill -0 "$launcher" 2>/dev/null && fail "the job still runs 40 s after rank $stop_rank stopped"
  wait "$launcher"
  rc=$?
  launcher=""
  [[ $rc -ne 0 ]] || fail "the job exited 0 with a stopped rank"
  # MPI: "<op> on communicator 'c' (...)"; shared memory: "<op> on shared memory of communicator 'c' (...)".
  pattern="fullshard\[rank [0-2]\]: [^ ].* on (shared memory of )?communicator '[^']*' \(rank [0-2]/[1-3], seq [0-9]+[^)]*\) did not finish within FULLSHARD_TIMEOUT=3 s; "
  line="$(grep -E -m1 "$pattern" "$work/out")" || fail "no timeout message naming operation, communicator, rank and sequence number"
  echo "job ended (exit $rc) with: $line"
  echo "PASS: a stopped rank ends the job with the timeout message"
  exit 0
fi

if [[ "$mode" == mismatch ]]; then
  expect() {  # expect NAME REGEX_RANK0 REGEX_RANK1 -- mpiexec arguments...
    local name="$1" r0="$2" r1="$3"
    shift 4
    timeout 60 "$mpiexec" "$@" >"$work/out" 2>&1
    local rc=$?
    [[ $rc -eq 2 ]] || fail "$name: exit code $rc, expected 2"
    grep -Eq "^heat-surrogate: rank 0: $r0" "$work/out" || fail "$name: rank 0 did not say: $r0"
    grep -Eq "^heat-surrogate: rank 1: $r1" "$work/out" || fail "$name: rank 1 did not say: $r1"
    echo "ok: $name: exit 2, both ranks named it"
  }
  expect "different --steps" \
    "--steps differs between ranks \(this rank: --steps 10\)" \
    "--steps differs between ranks \(this rank: --steps 20\)" -- \
    -n 1 "$heat" "${small[@]}" --steps 10 : -n 1 "$heat" "${small[@]}" --steps 20
  expect "different --train-ranks" \
    "--train-ranks differs between ranks \(this rank: --train-ranks 1\)" \
    "--train-ranks differs between ranks \(this rank: --train-ranks 0\)" -- \
    -n 1 "$heat" "${small[@]}" --steps 10 --train-ranks 1 : -n 1 "$heat" "${small[@]}" --steps 10
  expect "an option refused on one rank" \
    "--steps expects an integer in \\[1, [0-9]+\\], got 'ten' \\(see --help\\)" \
    "another rank refused its options" -- \
    -n 1 "$heat" "${small[@]}" --steps ten : -n 1 "$heat" "${small[@]}" --steps 10
  echo "PASS: ranks with different options exit 2 naming the option"
  exit 0
fi
echo "usage: heat_bounded.sh MPIEXEC HEAT stopped TRAIN_RANKS STOP_RANK | mismatch" >&2
exit 2
