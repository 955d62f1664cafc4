#!/usr/bin/env bash
# MPICH beside the default MPI (Debian: mpich libmpich-dev next to Open MPI): configuring with
# MPICH's C and C++ wrappers alone picks MPICH's Fortran wrapper too, keeps its Fortran flags
# (-fallow-argument-mismatch ...) off C and C++ sources, and a Fortran wrapper of another MPI
# stops the configure, naming the option to set. Configure only. Skipped (77) without MPICH's
# wrappers: scripts/setup does not install MPICH.
# Usage: mpich_wrappers.sh <cmake> <source dir> <scratch dir> [configure options...]
set -euo pipefail
cmake="$1" src="$2" work="$3"
shift 3
options=("$@")
for w in mpicc.mpich mpicxx.mpich mpif90.mpich; do
  command -v "$w" >/dev/null || { echo "mpich_wrappers: no $w (MPICH): skipped"; exit 77; }
done
rm -rf "$work"
mkdir -p "$work"
fail() { echo "mpich_wrappers: FAIL: $*"; exit 1; }
configure() {  # configure <dir> [options...]: the project without its tests, the log in <dir>.log
  local dir="$work/$1"
  shift
  "$cmake" -S "$src" -B "$dir" "${options[@]}" -DFULLSHARD_BUILD_TESTS=OFF \
    -DCMAKE_EXPORT_COMPILE_COMMANDS=ON \
    -DMPI_C_COMPILER=mpicc.mpich -DMPI_CXX_COMPILER=mpicxx.mpich "$@" >"$dir.log" 2>&1
}
cached() { sed -n "s/^$2:[A-Z]*=//p" "$work/$1/CMakeCache.txt"; }

# MPICH's C and C++ wrappers alone: Fortran's is MPICH's, next to them.
configure mpich || { cat "$work/mpich.log"; fail "configure with MPICH's C and C++ wrappers"; }
fortran="$(cached mpich MPI_Fortran_COMPILER)"
echo "mpich_wrappers: MPI_Fortran_COMPILER=$fortran ($(cached mpich MPI_Fortran_LIB_NAMES))"
[[ "$fortran" == "$(dirname "$(command -v mpicxx.mpich)")"/mpif*.mpich ]] \
  || fail "MPI_Fortran_COMPILER is $fortran, not MPICH's"
# MPI's Fortran flags: on the Fortran module's Fortran source, on none of C or C++.
python3 - "$work/mpich/compile_commands.json" "$(cached mpich MPI_Fortran_COMPILE_OPTIONS)" <<'EOF'
import json, os, sys
commands, options = json.load(open(sys.argv[1])), [o for o in sys.argv[2].split(";") if o]
print(f"mpich_wrappers: MPI's Fortran options {options}")
for entry in commands:
    ext = os.path.splitext(entry["file"])[1]
    args = entry.get("command", " ".join(entry.get("arguments", []))).split()
    present = [o for o in options if o in args]
    if ext in (".c", ".cpp", ".cu") and present:
        sys.exit(f"mpich_wrappers: FAIL: {entry['file']} compiles with {present}")
    if entry["file"].endswith("lib/fortran/fullshard.f90") and present != options:
        sys.exit(f"mpich_wrappers: FAIL: {entry['file']} compiles without {options}")
EOF

# Open MPI's Fortran wrapper with MPICH's C and C++: configuring stops, naming the option.
if command -v mpif90.openmpi >/dev/null; then
  if configure mismatch -DMPI_Fortran_COMPILER=mpif90.openmpi; then
    fail "configured with Open MPI's Fortran wrapper and MPICH's C and C++ wrappers"
  fi
  grep -q "C and Fortran found different MPIs" "$work/mismatch.log" \
    && grep -q -- "-DMPI_Fortran_COMPILER=.*mpif.*\.mpich" "$work/mismatch.log" \
    || { cat "$work/mismatch.log"; fail "no message naming the MPIs and the option"; }
  echo "mpich_wrappers: Open MPI's Fortran wrapper with MPICH's C and C++ refused"
fi
rm -rf "$work"
echo "mpich_wrappers: pass"
