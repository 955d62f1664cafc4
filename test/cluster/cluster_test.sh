#!/usr/bin/env bash
# Multi-node end to end, on the 2-node cluster of scripts/cluster-local (network + UTS + mount
# namespaces joined by a bridge; the CTest fixture cluster.up starts it): fullshard-train on
# 2 nodes x 2 ranks through mpirun (the cluster's launch agent, TCP pinned to the nodes'
# subnet) and through srun -N 2, against 4 ranks on one node (mpiexec -n 4 --oversubscribe).
#   cluster_test.sh CASE ROOT MPIEXEC TRAIN WORKDIR [TOUR CKPT HEAT]
# CASE: mpirun-fsdp   FSDP over 4 ranks (the shard dim spans the nodes)
#       mpirun-hsdp   HSDP --mesh 2x2 (replicate across the nodes, shard inside each)
#       srun-fsdp     FSDP over 4 ranks, srun -N 2 -n 4 --mpi=pmix
# The first three check the placement (ranks 0,1 on fsnode1, 2,3 on fsnode2), then compare the
# step losses with the one-node run's: within 1e-5 relative with the default host collectives
# (shared memory where ranks share a node), and bitwise equal when both runs force
# FULLSHARD_HOST_COLLECTIVES=mpi. Every run is bounded (timeout); a mismatch fails with both
# columns of losses.
#       two-level     node detection sees 2 nodes of 2 ranks with no FULLSHARD_RANKS_PER_NODE
#                     (fullshard-tour), and rank 0's trace (--trace) shows where each host
#                     collective ran: FSDP over 4 ranks on shared memory on one node, on
#                     shared memory inside each node and MPI across them (the two-level
#                     transport) on two; HSDP 2x2 across the nodes on shared memory inside
#                     the node (shard dim) and on MPI across (replicate dim), whose bytes the
#                     node's link carried
#       checkpoint-reshard  saved on 2 nodes x 2 ranks (HSDP 2x2, --stop-after), resumed on
#                     1 node x 3 ranks: steps after the resume within 1e-5 of the straight run
#       sbatch        scripts/slurm/*.sbatch unchanged with sbatch -N 2 (srun -v shows the
#                     tasks on both nodes); fullshard-train's losses equal mpirun's
#       link-down     a node's link cut in a training run (FULLSHARD_TIMEOUT=20): every rank,
#                     mpirun and orted gone within 60 s with a message naming the lost node;
#                     the newest checkpoint verifies; the link is restored (trap)
#       node-killed   fsnode2's ranks of an sbatch -N 2 job killed (SIGKILL): the job ends
#                     FAILED within 60 s, nothing left on the nodes; srun -N 1 -n 2 -w fsnode1
#                     resumes from the last checkpoint as the straight run goes on
#       lossy-link    1 % packet loss and 2 ms delay on fsnode2's link (netem, or where the
#                     kernel has none the relay scripts/link-relay; loss alone, an nft rule,
#                     when neither works): the round trip fsnode1 -> fsnode2 longer by 4 ms,
#                     the relay's or rule's drops > 0, losses bitwise equal to the unshaped
#                     run's; unshaped after (trap)
# The fault cases print a line "fault CASE: ..." (time from the fault to the end, message).
set -euo pipefail
case="$1" root="$2" mpiexec="$3" train="$4" work="$5" tour="${6:-}" ckpt_tool="${7:-}" heat="${8:-}"
cl="$root/scripts/cluster-local"
export OPENBLAS_NUM_THREADS=1 FULLSHARD_TIMEOUT=60
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
model=(--layers 2 --hidden 64 --inputs 16 --outputs 4 --batch 32 --seed 3 --steps 10)
dir="$work/$case"
rm -rf "$dir"
mkdir -p "$dir"
cd "$dir"  # on the shared file system: every node sees it (each node's /tmp is its own)

source "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/support/slurm_jobs.sh"  # show, fail, job_field, wait_ended

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
    run "$1" "$(dirname "$train")/fullshard-srun" -N 2 -n 4 --mpi=pmix "$train" "${model[@]}" "${@:2}"
    report_retries "$1.log"
  else
    run "$1" "$mpiexec" "${across[@]}" -x FULLSHARD_HOST_COLLECTIVES "$train" "${model[@]}" "${@:2}"
  fi
}
# Ranks 0 and 1 on fsnode1, 2 and 3 on fsnode2.
placement() {
  local launch=("$mpiexec" "${across[@]}") var=OMPI_COMM_WORLD_RANK
  [[ "$case" == srun-* ]] && launch=(srun -N 2 -n 4 --mpi=pmix) var=SLURM_PROCID
  # The launcher's own warnings (Open MPI's rsh agent: "setpgid(...) failed" where the machine
  # forbids it) go to stderr; the placement is read from the ranks' lines only.
  timeout 60 "${launch[@]}" bash -c "echo \$$var \$(hostname)" >place.log 2>place.err \
    || { cat place.err >>place.log; fail "${launch[*]} bash -c hostname exited with status $?" place.log; }
  grep -E '^[0-9]+ [^ ]+$' place.log | sort -n >place || true
  cat place.err >>place.log
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
# --- helpers of the cases below ---------------------------------------------------------------
need_arg() {  # need_arg WHAT PATH: an executable given on the command line (CMake passes them)
  [[ -n "$2" && -x "$2" ]] || fail "no $1 program given (cluster_test.sh CASE ROOT MPIEXEC TRAIN WORKDIR TOUR CKPT HEAT)"
}
# Processes of the nodes (their network namespaces) whose command name is one of NAMES, as
# "node:pid:name" words. The nodes share this machine's PID namespace: `pgrep` inside a node
# sees every process of the machine, `ip netns pids` only those of the node.
node_procs() {  # node_procs NAME...
  local n p c want=" $* "
  for n in fsnode1 fsnode2; do
    for p in $(ip netns pids "$n" 2>/dev/null); do
      c="$(cat "/proc/$p/comm" 2>/dev/null)" || continue
      [[ "$want" == *" $c "* ]] && echo -n "$n:$p:$c "
    done
  done
  return 0
}
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
# Step losses within 1e-5 relative, for the steps both files have; at least MIN of them.
within_steps() {  # within_steps WHAT REF GOT MIN
  join <(sort -k1,1 "$2") <(sort -k1,1 "$3") | sort -n >"$3.joined"
  awk -v label="$1" -v min="$4" '{ d = $2 - $3; if (d < 0) d = -d; a = $2 < 0 ? -$2 : $2
      if (d > 1e-5 * a) { printf "FAIL: %s: step %d loss %.9g, straight run %.9g\n", label, $1, $3, $2; bad = 1 }
      else if (a > 0 && d / a > worst) worst = d / a; n++ }
    END { if (n < min) { printf "FAIL: %s: %d common steps, expected at least %d\n", label, n, min; bad = 1 }
          if (!bad) printf "ok: %s: %d step(s) within 1e-5 relative of the straight run (largest %.2e)\n", label, n, worst
          exit bad }' "$3.joined" || { echo "(step straight this-run):"; cat "$3.joined"; exit 1; }
}
run_n() {  # run_n NAME COUNT LAUNCH...: as run, COUNT step lines
  local name="$1" count="$2"
  shift 2
  timeout 120 "$@" >"$name.log" 2>&1 || fail "$* exited with status $?" "$name.log"
  losses "$name.log" >"$name"
  [[ $(wc -l <"$name") -eq "$count" ]] || fail "$name: expected $count step lines" "$name.log"
}
# Slurm jobs: submitted from this directory, cancelled when the case ends early.
jobs_started=()
submit() {  # submit SBATCH-ARGS...: sets $job
  job="$(sbatch --parsable --chdir "$dir" "$@")" || fail "sbatch $* was refused"
  job="${job%%;*}"
  jobs_started+=("$job")
}
# Waits for job J (output PREFIX-J.out) to end; its retries (fullshard-srun: Open MPI's
# start-up crash) are printed and counted. Sets $job, $out and $state.
wait_job() {  # wait_job J PREFIX
  job="$1" out="$2-$1.out"
  wait_ended "$job" 120 "$out"
  report_retries "$out"
}
# Waits until job J's output PREFIX-J.out has a line matching ERE, at most S seconds. Sets
# $job and $out.
wait_job_line() {  # wait_job_line J PREFIX ERE S
  local t=0
  job="$1" out="$2-$1.out"
  until grep -qE "$3" "$out" 2>/dev/null; do
    ((t++ < $4 * 5)) || fail "no line matching '$3' in $out within $4 s (job $job: $(job_field "$job" JobState))" "$out"
    sleep 0.2
  done
}
wait_line() {  # wait_line FILE ERE S WHAT: until FILE has a line matching ERE, at most S seconds
  local t=0
  until grep -qE "$2" "$1" 2>/dev/null; do
    ((t++ < $3 * 5)) || fail "no line matching '$2' in $1 within $3 s ($4)" "$1"
    sleep 0.2
  done
}
cleanup_case() {  # EXIT trap of the cases below: no job, no shaping, no cut link left behind
  local j
  for j in ${jobs_started[@]+"${jobs_started[@]}"}; do scancel "$j" 2>/dev/null || true; done
  if [[ -n "${restore_link:-}" ]]; then
    "$cl" link fsnode2 up >/dev/null 2>&1 || echo "WARNING: could not bring fsnode2's link up again"
    "$cl" link fsnode2 unshape >/dev/null 2>&1 || echo "WARNING: could not unshape fsnode2's link"
  fi
  if [[ -n "${bg_pid:-}" ]] && kill -0 "$bg_pid" 2>/dev/null; then kill "$bg_pid" 2>/dev/null || true; fi
}
trap cleanup_case EXIT
# Host collectives of rank 0's trace: "COUNT OP on shared memory of 'DIM'" or
# "COUNT OP on communicator 'DIM.CHANNEL'" lines (the measured events of pid 1 carry these
# names; the plan's are AG(...), RS(...), AR(...)).
trace_ops() {  # trace_ops TRACE.json
  grep -oE "\"(all_gather|reduce_scatter|all_reduce|all_to_all) on (shared memory of|communicator) '[^']*'" "$1" \
    | tr -d '"' | sort | uniq -c | awk '{ $1 = $1; print }'
}
count_op() {  # count_op OPS_FILE OP TRANSPORT DIM: the count of that line (0 when absent)
  awk -v want="$2 on $3 '$4'" '{ c = $1; $1 = ""; sub(/^ /, ""); if ($0 == want) n = c } END { print n + 0 }' "$1"
}
link_bytes() {  # rx + tx bytes of fsnode2's link (its veth on the bridge)
  echo $(($(cat /sys/class/net/fsveth2/statistics/rx_bytes) + $(cat /sys/class/net/fsveth2/statistics/tx_bytes)))
}
# fsnode2's link shaping as `cluster-local status` shows it: "... (nft, N packets dropped)"
# or "... (link-relay, N of F frames dropped, held MIN-AVG-MAX ms min-avg-max)"; netem: no count.
link_shaping() { { "$cl" status 2>/dev/null || true; } | awk '$2 == "fsnode2" && !n++'; }
link_drops() {  # LINE: what the loss dropped (0 when the line has no count)
  sed -nE 's/.*[(](nft|link-relay), ([0-9]+) (packets|of [0-9]+ frames) dropped.*/\2/p' <<<"$1" | grep . || echo 0
}
relay_held_min() {  # LINE: the least time (ms) the relay held a frame
  sed -nE 's/.*link-relay, .* held ([0-9.]+)-[0-9.]+-[0-9.]+ ms.*/\1/p' <<<"$1"
}
# The least of 10 TCP handshakes fsnode1 -> fsnode2 (a SYN to a closed port, answered by a
# RST: one round trip; no ping on these machines), in ms.
rtt_ms() {
  "$cl" exec fsnode1 python3 -c '
import socket, time
best = None
for _ in range(10):
    s = socket.socket()
    s.settimeout(3)
    t = time.monotonic()
    try:
        s.connect(("fsnode2", 9))
    except ConnectionRefusedError:
        d = time.monotonic() - t
        best = d if best is None else min(best, d)
    except OSError:  # a SYN or RST lost: 1 s retransmission, not a round trip
        pass
    s.close()
print("%.3f" % (best * 1e3) if best is not None else "none")' || echo none
}

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
  two-level)
    need_arg fullshard-tour "$tour"
    unset FULLSHARD_RANKS_PER_NODE  # the node detection of MPI_Comm_split_type alone
    export FULLSHARD_HOST_COLLECTIVES=auto
    timeout 120 "$mpiexec" "${across[@]}" "$tour" >tour.log 2>&1 \
      || fail "fullshard-tour on 2 nodes x 2 ranks exited with status $?" tour.log
    grep -q "^runtime: 4 ranks (2 per node)" tour.log \
      || fail "the runtime does not see 2 nodes of 2 ranks ('runtime: 4 ranks (2 per node)')" tour.log
    for r in 0 1 2 3; do
      grep -q "^  rank $r: local rank $((r % 2)) of 2$" tour.log \
        || fail "rank $r is not local rank $((r % 2)) of 2 on its node" tour.log
    done
    echo "ok: node detection (no FULLSHARD_RANKS_PER_NODE): $(grep '^runtime:' tour.log | cut -d, -f1)"
    # FSDP over 4 ranks: on one node the shard dim is node-local (shared memory); across the
    # nodes it spans both: shared memory among each node's 2 ranks, MPI across the nodes.
    one_node fsdp1 --trace fsdp1.json
    trace_ops fsdp1.json >fsdp1.ops
    b0="$(link_bytes)"
    two_nodes fsdp2 --trace fsdp2.json
    b1="$(link_bytes)"
    trace_ops fsdp2.json >fsdp2.ops
    two_nodes hsdp2 --mesh 2x2 --trace hsdp2.json
    b2="$(link_bytes)"
    trace_ops hsdp2.json >hsdp2.ops
    for f in fsdp1 fsdp2 hsdp2; do echo "rank 0's host collectives, $f:"; sed 's/^/  /' "$f.ops"; done
    for op in all_gather reduce_scatter; do
      [[ $(count_op fsdp1.ops $op "shared memory of" "mesh(shard).shard") -gt 0 \
         && $(grep -c "communicator" fsdp1.ops) -eq 0 ]] \
        || fail "one node, FSDP over 4: $op is not all on shared memory" fsdp1.ops
      [[ $(count_op fsdp2.ops $op "shared memory of" "mesh(shard).shard.node") -gt 0 \
         && $(count_op fsdp2.ops $([[ $op == all_gather ]] && echo all_gather || echo all_to_all) communicator "mesh(shard).shard.across.$op") -gt 0 \
         && $(grep -c "communicator 'mesh(shard).shard.$op'" fsdp2.ops) -eq 0 ]] \
        || fail "two nodes, FSDP over 4 (the shard dim spans the nodes): $op is not on shared memory inside the node and MPI across" fsdp2.ops
      [[ $(count_op hsdp2.ops $op "shared memory of" "mesh(replicate,shard).shard") -gt 0 \
         && $(grep -c "$op on communicator" hsdp2.ops) -eq 0 ]] \
        || fail "two nodes, HSDP 2x2: $op of the shard dim (inside a node) is not all on shared memory" hsdp2.ops
    done
    [[ $(count_op hsdp2.ops all_reduce communicator "mesh(replicate,shard).replicate.all_reduce") -gt 0 \
       && $(grep -c "all_reduce on shared memory" hsdp2.ops) -eq 0 ]] \
      || fail "two nodes, HSDP 2x2: the replicate dim's all_reduce (across the nodes) is not on MPI" hsdp2.ops
    echo "ok: FSDP 4 ranks: shared memory on one node, shared memory inside and MPI across 2 nodes; HSDP 2x2 across 2 nodes: shard dim on shared memory, replicate dim on MPI"
    # The replicate all-reduce crossed fsnode2's link: at least rank 0's all-reduce bytes of
    # steps 2..10 went through it (ranks 2 and 3 each exchange as much with ranks 0 and 1).
    ar="$(awk '/^fullshard-train: [0-9]+ parameters/ { p = $2 }
               /^communicated per step/ { for (i = 1; i <= NF; i++) if ($i == "all-reduce") x = $(i + 1) }
               END { printf "%d", x * p * 4 }' hsdp2.log)"
    [[ "$ar" -gt 0 ]] || fail "no all-reduce bytes in the summary of the HSDP run" hsdp2.log
    echo "fsnode2's link carried $((b1 - b0)) bytes in the FSDP run, $((b2 - b1)) in the HSDP run (all-reduce: $ar bytes per step from rank 0)"
    (((b2 - b1) >= 9 * ar)) \
      || fail "fsnode2's link carried $((b2 - b1)) bytes in the HSDP run, less than 9 steps x $ar all-reduce bytes"
    (((b1 - b0) > (b2 - b1))) \
      || fail "FSDP across the nodes moved no more bytes over the link ($((b1 - b0))) than HSDP ($((b2 - b1)))"
    echo "ok: the replicate all-reduce crossed the link (>= 9 x $ar bytes); FSDP across the nodes moved $(awk -v a=$((b1 - b0)) -v b=$((b2 - b1)) 'BEGIN { printf "%.1f", a / b }') x HSDP's"
    ;;

  checkpoint-reshard)
    need_arg fullshard-ckpt "$ckpt_tool"
    flags=(--layers 2 --hidden 64 --inputs 16 --outputs 4 --batch 24 --seed 5 --warmup 4 --steps 20)
    run_n straight 20 "$mpiexec" "${across[@]}" "$train" "${flags[@]}" --mesh 2x2
    run_n first 10 "$mpiexec" "${across[@]}" "$train" "${flags[@]}" --mesh 2x2 --stop-after 10 \
      --checkpoint-dir "$dir/ckpt"
    grep -q "^checkpoint: step 10 saved to $dir/ckpt/step-00000010" first.log \
      || fail "no checkpoint at step 10 from the 2-node run" first.log
    cmp -s <(head -10 straight) first || fail "the first 10 steps differ from the straight run's" first.log
    "$ckpt_tool" verify "$dir/ckpt" >verify.log 2>&1 || fail "fullshard-ckpt verify $dir/ckpt failed" verify.log
    cat verify.log
    run_n resumed 10 "$mpiexec" -n 3 --oversubscribe "$train" "${flags[@]}" --resume "$dir/ckpt"
    grep -q "resumed from $dir/ckpt/step-00000010 at step 10" resumed.log \
      || fail "the 3-rank run did not resume from step 10" resumed.log
    grep -q "on (shard=3) rank 0" resumed.log || fail "the resumed run is not FSDP over 3 ranks" resumed.log
    within_steps "saved on 2 nodes x 2 ranks (HSDP 2x2), resumed on 1 node x 3 ranks" straight resumed 10
    ;;

  sbatch)
    need_arg heat-surrogate "$heat"
    PATH="$(dirname "$train"):$(dirname "$heat"):$PATH"
    unset TRAIN_CHECKPOINT_DIR TRAIN_SAVE_EVERY TRAIN_MAX_REQUEUES
    # srun -v in the job scripts (SLURM_DEBUG is srun's -v): "launching StepId=J.0 on host ..."
    export SLURM_DEBUG=1 TRAIN_SAVE_EVERY=10
    nodes2=(-N 2 --ntasks-per-node=2 -c1 --gpus-per-node=0)
    small=(--layers 2 --hidden 32 --inputs 16 --outputs 4 --batch 32 --seed 3)
    on_both() {  # on_both J OUT: srun launched 2 tasks on each node
      grep -q "launching StepId=$1.0 on host fsnode1, 2 tasks: \[0-1\]" "$2" \
        && grep -q "launching StepId=$1.0 on host fsnode2, 2 tasks: \[2-3\]" "$2" \
        || fail "job $1: srun did not launch tasks 0-1 on fsnode1 and 2-3 on fsnode2" "$2"
      grep -qE "fsnode2: tasks 2-3: Completed" "$2" || fail "job $1: no 'fsnode2: tasks 2-3: Completed'" "$2"
      echo "ok: job $1: srun launched tasks 0-1 on fsnode1 and 2-3 on fsnode2 (srun -v), both completed"
    }
    run_n ref 20 "$mpiexec" "${across[@]}" "$train" "${small[@]}" --steps 20 --mesh 2x2
    # Both jobs queued at once: they run one after the other (each takes both nodes' CPUs).
    train_job=("${nodes2[@]}" "$root/scripts/slurm/fullshard-train.sbatch" "${small[@]}" --steps 20 --log-every 1)
    heat_job=("${nodes2[@]}" "$root/scripts/slurm/heat-surrogate.sbatch" --nx 96 --ny 96 --steps 600
      --interval 4 --radius 2 --samples 256 --eval-points 256 --hidden 64 --blocks 2 --batch 128 --report-every 50)
    submit "${train_job[@]}"
    jt="$job"
    submit "${heat_job[@]}"
    jh="$job"
    wait_job "$jt" fullshard-train
    [[ "$state" == COMPLETED ]] || fail "job $jt ended $state (exit code $(job_field "$jt" ExitCode))" "$out"
    grep -q "run 0 of this job on fsnode\[1-2\], 4 ranks" "$out" || fail "job $jt: not 4 ranks on fsnode[1-2]" "$out"
    grep -q "on (replicate=2, shard=2) rank 0" "$out" || fail "job $jt: the script did not pick HSDP 2x2 on 2 nodes" "$out"
    on_both "$jt" "$out"
    for st in 10 20; do
      grep -q "checkpoint: step $st saved to $dir/fullshard-train-$jt.ckpt/" "$out" || fail "job $jt: no checkpoint at step $st" "$out"
    done
    losses "$out" >job
    bitwise "sbatch -N 2 fullshard-train.sbatch against mpirun --mesh 2x2" ref job
    wait_job "$jh" heat-surrogate
    [[ "$state" == COMPLETED ]] || fail "job $jh ended $state (exit code $(job_field "$jh" ExitCode))" "$out"
    grep -q "^ranks: 2 simulate .*, 2 train (ranks 0-1)" "$out" \
      || fail "job $jh: heat-surrogate did not split 2 simulating + 2 training ranks (--train-ranks 2)" "$out"
    grep -qE "^verdict: PASS" "$out" || fail "job $jh: no PASS verdict" "$out"
    on_both "$jh" "$out"
    echo "ok: job $jh: $(grep '^ranks:' "$out"); $(grep '^verdict' "$out")"
    ;;

  link-down)
    need_arg fullshard-ckpt "$ckpt_tool"
    export FULLSHARD_TIMEOUT=20
    restore_link=1
    timeout 150 "$mpiexec" "${across[@]}" "$train" --layers 2 --hidden 64 --inputs 16 --outputs 4 \
      --batch 32 --seed 3 --steps 100000000 --save-every 100 \
      --log-every 100 --checkpoint-dir "$dir/ckpt" >run.log 2>&1 &
    bg_pid=$!
    wait_line run.log "^checkpoint: step [0-9]+ saved" 60 "the training run across the nodes"
    "$cl" link fsnode2 down
    t0="$(now)"
    ranks_at="" mpirun_at=""
    while :; do
      left="$(node_procs fullshard-train orted)"
      [[ -z "$ranks_at" && "$left" != *fullshard-train* ]] && ranks_at="$(since "$t0")"
      [[ -z "$mpirun_at" ]] && ! kill -0 "$bg_pid" 2>/dev/null && mpirun_at="$(since "$t0")"
      [[ -n "$ranks_at" && -n "$mpirun_at" && -z "$left" ]] && break
      awk -v t="$(since "$t0")" 'BEGIN { exit !(t > 60) }' \
        && fail "60 s after the link went down: still running: ${left:-}$([[ -z "$mpirun_at" ]] && echo " mpirun")" run.log
      sleep 0.2
    done
    clean_at="$(since "$t0")"
    rc=0
    wait "$bg_pid" || rc=$?
    bg_pid=""
    "$cl" link fsnode2 up
    # Slurm may have seen fsnode2 not responding meanwhile: let it answer again (the next
    # cases submit jobs to it).
    for ((t = 0; t < 150; t++)); do
      [[ "$(sinfo -h -n fsnode2 -o %T 2>/dev/null)" =~ ^(idle|mixed|allocated)$ ]] && break
      sleep 0.2
    done
    ((rc != 0)) || fail "mpirun exited with status 0 after fsnode2's link went down" run.log
    [[ -z "$(pgrep -f "$dir/ckpt" || true)" ]] || fail "processes of this run are left: $(pgrep -af "$dir/ckpt")"
    grep -v '^step ' run.log | tail -25
    msg="$(grep -m1 -E "ORTE has lost communication with a remote daemon|did not finish within FULLSHARD_TIMEOUT" run.log || true)"
    [[ -n "$msg" ]] || fail "no message about the lost node or the collective that timed out" run.log
    peer="$(grep -m1 -oE "Remote daemon: .* on node fsnode2|waiting for rank [0-9]+|FULLSHARD_TIMEOUT=20" run.log || true)"
    echo "ok: every rank gone ${ranks_at} s, mpirun ${mpirun_at} s, the last orted ${clean_at} s after fsnode2's link went down (mpirun status $rc)"
    "$ckpt_tool" verify "$dir/ckpt" >verify.log 2>&1 || fail "the newest checkpoint does not verify" verify.log
    cat verify.log
    echo "fault link-down: last rank exit ${ranks_at} s, job (mpirun) ended ${mpirun_at} s, nothing left ${clean_at} s after the fault; message: $msg [$peer]"
    ;;

  node-killed)
    need_arg fullshard-ckpt "$ckpt_tool"
    PATH="$(dirname "$train"):$PATH"
    export FULLSHARD_TIMEOUT=20
    unset TRAIN_MAX_REQUEUES SLURM_DEBUG
    export TRAIN_CHECKPOINT_DIR="$dir/ckpt" TRAIN_SAVE_EVERY=100
    small=(--layers 2 --hidden 64 --inputs 16 --outputs 4 --batch 32 --seed 3 --steps 100000000)
    killed_job=(-N 2 --ntasks-per-node=2 -c1 --gpus-per-node=0 "$root/scripts/slurm/fullshard-train.sbatch"
      "${small[@]}" --log-every 100)
    submit "${killed_job[@]}"
    wait_job_line "$job" fullshard-train "^checkpoint: step [0-9]+ saved" 90
    j="$job"
    victims="$(node_procs fullshard-train | tr ' ' '\n' | awk -F: '$1 == "fsnode2" { print $2 }')"
    [[ $(wc -w <<<"$victims") -eq 2 ]] || fail "expected 2 fullshard-train ranks on fsnode2, found: $(node_procs fullshard-train)" "$out"
    # (not `pkill -f` inside the node: the nodes share this machine's PID namespace)
    # shellcheck disable=SC2086
    kill -KILL $victims
    t0="$(now)"
    ranks_at=""
    while :; do
      left="$(node_procs fullshard-train slurmstepd)"
      [[ -z "$ranks_at" && "$left" != *fullshard-train* ]] && ranks_at="$(since "$t0")"
      st="$(job_field "$j" JobState)"
      [[ -n "$ranks_at" && -z "$left" && "$st" != RUNNING && "$st" != COMPLETING ]] && break
      awk -v t="$(since "$t0")" 'BEGIN { exit !(t > 60) }' \
        && fail "60 s after fsnode2's ranks were killed: job $j is $st; still running: $left" "$out"
      sleep 0.2
    done
    clean_at="$(since "$t0")"
    [[ "$st" == FAILED ]] || fail "job $j ended $st, expected FAILED" "$out"
    echo "ok: job $j FAILED (exit code $(job_field "$j" ExitCode)); last rank gone ${ranks_at} s, no slurmstepd ${clean_at} s after the kill"
    grep -E "srun: error|ended with status|did not finish within" "$out" | head -8
    msg="$(grep -m1 -E "srun: error: fsnode2: tasks? [0-9-]+: Killed" "$out" || true)"
    [[ -n "$msg" ]] || fail "no 'srun: error: fsnode2: tasks 2-3: Killed' message" "$out"
    grep -q "srun fullshard-train ended with status [1-9][0-9]*: the job ends here" "$out" \
      || fail "no message from the job script" "$out"
    "$ckpt_tool" verify "$dir/ckpt" >verify.log 2>&1 || fail "the newest checkpoint does not verify" verify.log
    cat verify.log
    s="$(sed -n 's/^ok: .*\/step-0*\([0-9][0-9]*\): .*/\1/p' verify.log)"
    [[ -n "$s" && "$s" -ge 100 ]] || fail "no checkpoint step in fullshard-ckpt verify's output" verify.log
    # A new job on the node that is left, with 2 ranks instead of 4, resumes from step s.
    unset TRAIN_CHECKPOINT_DIR TRAIN_SAVE_EVERY
    timeout 90 "$(dirname "$train")/fullshard-srun" -N 1 -n 2 -w fsnode1 --mpi=pmix "$train" "${small[@]}" --resume "$dir/ckpt" \
      --stop-after $((s + 10)) >resumed.log 2>&1 || fail "srun -N 1 -n 2 -w fsnode1 (resume) exited with status $?" resumed.log
    grep -q "resumed from $dir/ckpt/step-0*$s at step $s" resumed.log \
      || fail "the new job did not resume from step $s" resumed.log
    losses resumed.log >resumed
    [[ $(wc -l <resumed) -eq 10 ]] || fail "the resumed run: expected 10 step lines" resumed.log
    # The straight run: 4 ranks, HSDP 2x2 as the job script ran it, on one node.
    timeout 120 "$mpiexec" -n 4 --oversubscribe "$train" "${small[@]}" --mesh 2x2 --stop-after $((s + 10)) \
      --log-every 1 >straight.log 2>&1 || fail "the straight run exited with status $?" straight.log
    losses straight.log >straight
    within_steps "job $j (2 nodes x 2 ranks, killed after step $s) resumed on fsnode1 x 2 ranks" straight resumed 10
    losses "$out" >job
    within_steps "job $j's steps before the kill" straight job 1
    echo "fault node-killed: last rank exit ${ranks_at} s, job FAILED and nothing left ${clean_at} s after the kill; message: $msg; resumed from step $s on 1 node x 2 ranks"
    ;;

  lossy-link)
    export FULLSHARD_TIMEOUT=20 FULLSHARD_HOST_COLLECTIVES=auto
    restore_link=1
    long=(--layers 2 --hidden 64 --inputs 16 --outputs 4 --batch 32 --seed 3 --steps 200 --log-every 1)
    t0="$(now)"
    timeout 150 "$mpiexec" "${across[@]}" "$train" "${long[@]}" >clean.log 2>&1 \
      || fail "the unshaped run exited with status $?" clean.log
    t_clean="$(since "$t0")"
    rtt_clean="$(rtt_ms)"
    shaped="loss 1%"
    if "$cl" link fsnode2 shape --loss 1% --delay 2ms >shape.log 2>&1; then
      shaped="loss 1%, delay 2 ms"
    else
      echo "note: no 2 ms delay: $(grep -o 'needs .*' shape.log || cat shape.log)"
      "$cl" link fsnode2 shape --loss 1% >shape.log 2>&1 || fail "cluster-local link fsnode2 shape --loss 1% failed" shape.log
    fi
    cat shape.log
    rtt_shaped="$(rtt_ms)"
    if [[ "$shaped" == *delay* ]]; then
      # 2 ms each way on fsnode2's link: a round trip fsnode1 -> fsnode2 4 ms longer
      awk -v a="$rtt_clean" -v b="$rtt_shaped" 'BEGIN { exit !(a != "none" && b != "none" && b - a >= 3.9) }' \
        || fail "the round trip fsnode1 -> fsnode2 is ${rtt_shaped} ms shaped, ${rtt_clean} ms unshaped: the 2 ms delay each way is not there" shape.log
    fi
    t0="$(now)"
    timeout 150 "$mpiexec" "${across[@]}" "$train" "${long[@]}" >lossy.log 2>&1 \
      || fail "the run over the lossy link exited with status $?" lossy.log
    t_lossy="$(since "$t0")"
    sleep 1.2  # the relay rewrites its counters every second
    line="$(link_shaping)"
    echo "$line"
    drops="$(link_drops "$line")"
    med() { sed -n 's/^summary: .*median step \([0-9.]*\) ms.*/\1/p' "$1"; }
    "$cl" link fsnode2 unshape
    losses clean.log >clean
    losses lossy.log >lossy
    [[ $(wc -l <clean) -eq 200 && $(wc -l <lossy) -eq 200 ]] || fail "expected 200 step lines in both runs" clean.log lossy.log
    case "$line" in
      *link-relay*) by="link-relay"
        held="$(relay_held_min "$line")"
        awk -v h="$held" 'BEGIN { exit !(h != "" && h >= 2) }' \
          || fail "the relay held frames ${held:-?} ms at least, not 2 ms: $line" ;;
      *nft*) by="the nft rule" ;;
      *) by="netem" ;;  # no drop count
    esac
    [[ "$by" == netem || "$drops" -gt 0 ]] \
      || fail "$by dropped nothing: the lossy run did not test a lossy link ($line)"
    bitwise "$shaped on fsnode2's link ($by dropped $drops) against the unshaped link" clean lossy
    echo "fault lossy-link: $shaped by $by ($drops dropped; round trip fsnode1 -> fsnode2 ${rtt_shaped} ms, unshaped ${rtt_clean} ms): training completed, 200 steps in ${t_lossy} s (unshaped ${t_clean} s, launch included), median step $(med lossy.log) ms (unshaped $(med clean.log) ms); losses bitwise equal"
    ;;

  *)
    echo "cluster_test.sh: unknown case '$case'" >&2
    exit 2
    ;;
esac
echo "cluster $case: ok (retries of Open MPI's start-up crash: $retries)"
