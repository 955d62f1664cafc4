#!/usr/bin/env bash
# Multi-node end to end, on the 2-node cluster of scripts/cluster-local (network + UTS + mount
# namespaces joined by a bridge; the CTest fixture cluster.up starts it): fullshard-train on
# 2 nodes x 2 ranks through mpirun (the cluster's launch agent, TCP pinned to the nodes'
# subnet) and through srun -N 2, against 4 ranks on one node (mpiexec -n 4 --oversubscribe).
#   cluster_test.sh CASE ROOT MPIEXEC TRAIN WORKDIR
# CASE: mpirun-fsdp   FSDP over 4 ranks (the shard dim spans the nodes)
#       mpirun-hsdp   HSDP --mesh 2x2 (replicate across the nodes, shard inside each)
#       srun-fsdp     FSDP over 4 ranks, srun -N 2 -n 4 --mpi=pmix
# Each case checks the placement (ranks 0,1 on fsnode1, 2,3 on fsnode2), then compares the
# step losses with the one-node run's: within 1e-5 relative with the default host collectives
# (shared memory where ranks share a node), and bitwise equal when both runs force
# FULLSHARD_HOST_COLLECTIVES=mpi. Every run is bounded (timeout); a mismatch fails with both
# columns of losses.
set -euo pipefail
case="$1" root="$2" mpiexec="$3" train="$4" work="$5"
cl="$root/scripts/cluster-local"
export OPENBLAS_NUM_THREADS=1 FULLSHARD_TIMEOUT=60
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
model=(--layers 2 --hidden 64 --inputs 16 --outputs 4 --batch 32 --seed 3 --steps 10)
dir="$work/$case"
rm -rf "$dir"
mkdir -p "$dir"
cd "$dir"  # on the shared file system: every node sees it (each node's /tmp is its own)

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

[[ "$(id -u)" -eq 0 ]] || fail "needs root (scripts/cluster-local makes namespaces and starts daemons)"
"$mpiexec" --version 2>&1 | grep -qE "Open MPI|OpenRTE|open-mpi" \
  || fail "$mpiexec is not Open MPI's: the cluster's launch agent and transport pins are Open MPI MCA parameters"
"$cl" status >status.log 2>&1 \
  || fail "the 2-node cluster is not up (scripts/cluster-local start 2; the fixture cluster.up starts it)" status.log
# The nodes share this machine's file system except /tmp and /dev/shm (their own).
"$cl" exec fsnode1 test -x "$train" -a -d "$dir" \
  || fail "the nodes do not see $train or $dir (each node has its own /tmp: start the cluster with --share BUILD_DIR)"
eval "$("$cl" env)"  # SLURM_CONF and the OMPI_MCA_* transport pins
read -r -a across <<<"$("$cl" mpi-args)"
across+=(--host "fsnode1:2,fsnode2:2" -n 4 -x OPENBLAS_NUM_THREADS -x FULLSHARD_TIMEOUT)

losses() { awk '$1 == "step" && $3 == "loss" { print $2, $4 }' "$1"; }
# run NAME LAUNCH...: the launch's output in NAME.log, its step losses in NAME
run() {
  local name="$1"
  shift
  timeout 120 "$@" >"$name.log" 2>&1 || fail "$* exited with status $?" "$name.log"
  losses "$name.log" >"$name"
  [[ $(wc -l <"$name") -eq 10 ]] || fail "$name: expected 10 step lines" "$name.log"
}
one_node() { run "$1" "$mpiexec" -n 4 --oversubscribe "$train" "${model[@]}" "${@:2}"; }
two_nodes() {
  if [[ "$case" == srun-* ]]; then
    run "$1" srun -N 2 -n 4 --mpi=pmix "$train" "${model[@]}" "${@:2}"
  else
    run "$1" "$mpiexec" "${across[@]}" -x FULLSHARD_HOST_COLLECTIVES "$train" "${model[@]}" "${@:2}"
  fi
}
# Ranks 0 and 1 on fsnode1, 2 and 3 on fsnode2.
placement() {
  local launch=("$mpiexec" "${across[@]}") var=OMPI_COMM_WORLD_RANK
  [[ "$case" == srun-* ]] && launch=(srun -N 2 -n 4 --mpi=pmix) var=SLURM_PROCID
  timeout 60 "${launch[@]}" bash -c "echo \$$var \$(hostname)" >place.log 2>&1 \
    || fail "${launch[*]} bash -c hostname exited with status $?" place.log
  sort -n place.log >place
  printf '0 fsnode1\n1 fsnode1\n2 fsnode2\n3 fsnode2\n' | cmp -s - place \
    || fail "the ranks are not 2 per node (want 0,1 on fsnode1 and 2,3 on fsnode2)" place.log
  echo "ok: placement: $(tr '\n' ' ' <place)"
}
within() {  # within WHAT A B: equal step numbers, losses within 1e-5 relative
  paste -d' ' "$2" "$3" | awk '{ d = $2 - $4; if (d < 0) d = -d; m = ($2 < 0 ? -$2 : $2)
      if ($1 != $3 || d > 1e-5 * m) bad = 1 } END { exit bad }' \
    || { echo "FAIL: $case: $1: step losses differ by more than 1e-5 relative (one node | two nodes):"; paste -d'|' "$2" "$3"; exit 1; }
  echo "ok: $1: $(wc -l <"$3") step losses within 1e-5 relative"
}
bitwise() {  # bitwise WHAT A B: identical step/loss lines
  cmp -s "$2" "$3" \
    || { echo "FAIL: $case: $1: step losses not bitwise equal (one node | two nodes):"; paste -d'|' "$2" "$3"; exit 1; }
  echo "ok: $1: $(wc -l <"$3") step losses bitwise equal"
}

mesh=()
[[ "$case" == mpirun-hsdp ]] && mesh=(--mesh 2x2)
case "$case" in
  mpirun-fsdp | mpirun-hsdp | srun-fsdp)
    placement
    export FULLSHARD_HOST_COLLECTIVES=auto
    one_node ref "${mesh[@]}"
    two_nodes got "${mesh[@]}"
    grep -q "rank 0" got.log || fail "no rank-0 line from fullshard-train" got.log
    within "host collectives auto" ref got
    export FULLSHARD_HOST_COLLECTIVES=mpi
    one_node ref-mpi "${mesh[@]}"
    two_nodes got-mpi "${mesh[@]}"
    bitwise "FULLSHARD_HOST_COLLECTIVES=mpi" ref-mpi got-mpi
    echo "last step: one node: $(tail -1 ref-mpi), two nodes: $(tail -1 got-mpi)"
    ;;
  *)
    echo "cluster_test.sh: unknown case '$case'" >&2
    exit 2
    ;;
esac
echo "cluster $case: ok"
