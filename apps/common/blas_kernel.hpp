// The fullshard programs run their matrix products on the BLAS kernel their CPU is made for.
#pragma once

#include <string>

namespace fullshard::apps {

/// Call first in main(), before the Runtime (MPI) starts. When the loaded OpenBLAS chose a
/// kernel below what the CPU runs (Debian's OpenBLAS 0.3.21 takes its generic "Prescott"
/// kernel on CPUs it does not know) and OPENBLAS_CORETYPE is unset, it sets
/// OPENBLAS_CORETYPE to the right kernel and runs the program again in the same process
/// (execv: same PID, arguments and environment, so launchers see nothing); OpenBLAS reads
/// the variable only when it loads. FULLSHARD_BLAS_KERNEL: auto (the default) keeps an
/// OPENBLAS_CORETYPE the user set, best replaces even that one when it is generic, keep
/// changes nothing (anything else: exit 2). Returns (without exec) when nothing is to
/// change, or when exec fails (with a line that says so).
void run_on_best_blas_kernel(char** argv);

/// "OPENBLAS_CORETYPE=SkylakeX (set by the program)" when run_on_best_blas_kernel chose the
/// kernel, "OPENBLAS_CORETYPE=... (yours)" when the user did, empty otherwise: for summaries.
std::string blas_kernel_choice();

}  // namespace fullshard::apps
