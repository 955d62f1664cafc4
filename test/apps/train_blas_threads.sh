#!/usr/bin/env bash
# fullshard-train names its BLAS, kernel and threads, runs on the kernel its CPU is made for,
# and gives the BLAS and Kokkos the rank's share of the cores.
#   train_blas_threads.sh MPIEXEC TRAIN_BINARY kernel|threads|kokkos
# kernel:  with OPENBLAS_CORETYPE=Prescott forced on a CPU with AVX2, the library's start line
#          names the generic kernel and the setting that fixes it, and the summary names the
#          BLAS and kernel; with nothing set the kernel fits the CPU (OpenBLAS's choice, or the
#          program's when OpenBLAS took a generic one); FULLSHARD_BLAS_KERNEL=best runs the
#          program again on the right kernel (the summary says it chose it), keep keeps the
#          forced one; the losses agree within 1e-5 relative on either kernel.
# threads: 2 ranks with no thread variable: the start line's thread count is what OpenBLAS
#          got and the summary shows; with OPENBLAS_NUM_THREADS set, the user's count stays.
# kokkos:  4 ranks, no thread variable, a Kokkos with host threads (OpenMP): Kokkos runs the
#          rank's share; exit 77 (skipped) with a Serial Kokkos.
set -euo pipefail
mpiexec="$1" train="$2" mode="$3"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
flags=(--steps 4 --log-every 1 --layers 2 --hidden 64 --inputs 16 --outputs 4 --batch 32 --seed 3)
unset OPENBLAS_CORETYPE OPENBLAS_NUM_THREADS GOTO_NUM_THREADS OMP_NUM_THREADS KOKKOS_NUM_THREADS \
  FULLSHARD_BLAS_KERNEL FULLSHARD_BLAS_KERNEL_CHOSEN SLURM_CPUS_PER_TASK

launch=()  # mpiexec options
fail() { echo "FAIL: $1"; [[ -n "${2:-}" ]] && cat "$2"; exit 1; }
run() {  # run RANKS OUT [env...]: fullshard-train's output in OUT
  local n="$1" out="$2"
  shift 2
  env "$@" "$mpiexec" ${launch[@]+"${launch[@]}"} -n "$n" "$train" "${flags[@]}" >"$out" 2>&1 \
    || fail "fullshard-train -n $n ($*) exited with an error:" "$out"
}
has_flag() { grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | grep -qw "$1"; }

case "$mode" in
  kernel)
    has_flag avx2 || { echo "SKIPPED: this CPU has no AVX2: no better OpenBLAS kernel to choose"; exit 77; }
    run 1 "$work/forced" OPENBLAS_CORETYPE=Prescott
    grep -q "^BLAS: OpenBLAS" "$work/forced" || { echo "SKIPPED: this build's BLAS is not OpenBLAS"; cat "$work/forced"; exit 77; }
    grep -qE "^fullshard: warning: OpenBLAS [0-9.]+ runs its Prescott kernel \(OPENBLAS_CORETYPE=Prescott\) on a CPU with [^:]*AVX2[^:]*: .*set OPENBLAS_CORETYPE=(Haswell|SkylakeX) in the environment" "$work/forced" \
      || fail "no start line naming the generic kernel and its fix:" "$work/forced"
    grep -qE "^BLAS: OpenBLAS [0-9.]+ \(kernel Prescott, .*\), OPENBLAS_CORETYPE=Prescott \(yours\) on a CPU with .*AVX2.* \(a generic kernel: OPENBLAS_CORETYPE=(Haswell|SkylakeX) is faster\)$" "$work/forced" \
      || fail "the summary does not name the BLAS and its generic kernel:" "$work/forced"
    echo "ok: forced Prescott: $(grep '^BLAS:' "$work/forced")"
    # With nothing set the kernel fits the CPU: OpenBLAS's own choice, or the program's.
    run 1 "$work/default"
    grep -qE "^BLAS: OpenBLAS [0-9.]+ \(kernel (Haswell|Zen|SkylakeX|Cooperlake|SapphireRapids), " "$work/default" \
      || fail "with nothing set, the program did not run on a kernel its CPU is made for:" "$work/default"
    ! grep -q "runs its .* kernel" "$work/default" || fail "a warning about the kernel with nothing set:" "$work/default"
    echo "ok: nothing set: $(grep '^BLAS:' "$work/default")"
    # FULLSHARD_BLAS_KERNEL=best replaces even a generic kernel the environment chose: the
    # program runs itself again on the right one.
    run 1 "$work/chosen" OPENBLAS_CORETYPE=Prescott FULLSHARD_BLAS_KERNEL=best
    grep -qE "^BLAS: OpenBLAS [0-9.]+ \(kernel (Haswell|SkylakeX), .*\), OPENBLAS_CORETYPE=(Haswell|SkylakeX) \(set by the program\) on a CPU with" "$work/chosen" \
      || fail "FULLSHARD_BLAS_KERNEL=best did not run the program again on the right kernel:" "$work/chosen"
    ! grep -q "runs its .* kernel" "$work/chosen" || fail "a warning about the kernel the program chose:" "$work/chosen"
    echo "ok: best: $(grep '^BLAS:' "$work/chosen")"
    # FULLSHARD_BLAS_KERNEL=keep: the kernel stays (and is named); a bad value is refused.
    run 1 "$work/kept" OPENBLAS_CORETYPE=Prescott FULLSHARD_BLAS_KERNEL=keep
    grep -qE "^BLAS: OpenBLAS [0-9.]+ \(kernel Prescott, " "$work/kept" || fail "FULLSHARD_BLAS_KERNEL=keep did not keep the kernel:" "$work/kept"
    rc=0
    FULLSHARD_BLAS_KERNEL=fast "$mpiexec" -n 1 "$train" "${flags[@]}" >"$work/bad" 2>&1 || rc=$?
    [[ $rc -eq 2 ]] && grep -q "FULLSHARD_BLAS_KERNEL='fast' is invalid: expected auto, best or keep" "$work/bad" \
      || fail "FULLSHARD_BLAS_KERNEL=fast: exit $rc, expected 2 with a message:" "$work/bad"
    # The same losses on either kernel (summation order inside the products differs).
    paste <(awk '$1 == "step" { print $4 }' "$work/forced") <(awk '$1 == "step" { print $4 }' "$work/chosen") \
      | awk '{ d = $1 - $2; if (d < 0) d = -d; a = $1 < 0 ? -$1 : $1; n++
               if (d > 1e-5 * a) { print "FAIL: step loss " $1 " on Prescott, " $2 " on the chosen kernel"; bad = 1 } }
             END { if (n != 4) { print "FAIL: " n " steps compared, expected 4"; bad = 1 }
                   if (!bad) print "ok: 4 step losses within 1e-5 on both kernels"; exit bad }'
    ;;
  threads)
    run 2 "$work/default"
    line="$(grep -E "^fullshard: [0-9]+ threads? per rank \(" "$work/default" || true)"
    [[ -n "$line" ]] || fail "no start line with the threads per rank:" "$work/default"
    n="$(sed -E 's/^fullshard: ([0-9]+) .*/\1/' <<<"$line")"
    grep -qE "OpenBLAS $n\$|OpenBLAS $n," <<<"$line" || fail "OpenBLAS did not get the rank's $n threads: $line"
    grep -qE "^BLAS: OpenBLAS .*, $n threads?\)" "$work/default" || fail "the summary does not show $n BLAS threads:" "$work/default"
    echo "ok: $line"
    # Unbound (OpenBLAS never runs more threads than the CPUs a rank may use): the user's 2.
    launch=(--bind-to none)
    run 2 "$work/user" OPENBLAS_NUM_THREADS=2
    grep -qE "^fullshard: [0-9]+ threads? per rank .*OpenBLAS 2 \(OPENBLAS_NUM_THREADS=2, yours\)" "$work/user" \
      || fail "OPENBLAS_NUM_THREADS=2 was not kept:" "$work/user"
    grep -qE "^BLAS: OpenBLAS .*, 2 threads\)" "$work/user" || fail "the summary does not show the user's 2 threads:" "$work/user"
    echo "ok: $(grep -E '^fullshard: [0-9]+ threads? per rank' "$work/user")"
    ;;
  kokkos)
    run 4 "$work/default"
    line="$(grep -E "^fullshard: [0-9]+ threads? per rank \(" "$work/default" || true)"
    [[ "$line" == *"Kokkos "* ]] || {
      echo "SKIPPED: this build's Kokkos runs no host threads (Serial); build against a Kokkos with"
      echo "OpenMP to run this test (docs/guide/blas-threads.md, 'Threads per rank')"
      exit 77
    }
    n="$(sed -E 's/^fullshard: ([0-9]+) .*/\1/' <<<"$line")"
    grep -qE "Kokkos [A-Za-z]+ $n(,|\$)" <<<"$line" || fail "Kokkos did not get the rank's $n threads: $line"
    echo "ok: $line"
    run 4 "$work/user" OMP_NUM_THREADS=2
    grep -qE "Kokkos [A-Za-z]+ 2 \(OMP_NUM_THREADS=2, yours\)" "$work/user" || fail "OMP_NUM_THREADS=2 was not kept:" "$work/user"
    echo "ok: $(grep -E '^fullshard: [0-9]+ threads? per rank' "$work/user")"
    ;;
  *) fail "unknown mode '$mode'" ;;
esac
echo "pass: $mode"
