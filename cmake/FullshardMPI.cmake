# Finding MPI, in one place for the build and for the installed package config.
#
# FindMPI looks for each language's wrapper on its own: with Open MPI the default MPI (Debian's
# alternatives) and MPICH installed too, -DMPI_CXX_COMPILER=mpicxx.mpich gives MPICH for C++ and
# Open MPI's mpif90 for Fortran, and the build fails late, linking Open MPI's mpi_f08 against
# MPICH. fullshard_mpi_pick_siblings() picks the other languages' wrappers from the one given,
# fullshard_mpi_check_same() stops at configure time when the languages' MPIs still differ, and
# fullshard_mpi_fortran_options_fortran_only() keeps MPI's Fortran flags off C and C++ sources.

# The wrapper for language `lang` of the family of wrapper `given` (a path): the same directory
# and suffix (mpicxx.mpich: mpicc.mpich, mpif90.mpich), if it exists; otherwise empty.
function(_fullshard_mpi_sibling out given lang)
  set(_fs_names_CXX mpicxx mpic++ mpiCC)
  set(_fs_names_C mpicc)
  set(_fs_names_Fortran mpif90 mpifort)
  set(${out} "" PARENT_SCOPE)
  get_filename_component(_fs_name "${given}" NAME)
  if(NOT IS_ABSOLUTE "${given}"
     OR NOT _fs_name MATCHES "^mpi(cxx|c\\+\\+|CC|cc|f90|fort|f77)(.*)$")
    return()
  endif()
  set(_fs_suffix "${CMAKE_MATCH_2}")
  get_filename_component(_fs_dir "${given}" DIRECTORY)
  foreach(_fs_name IN LISTS _fs_names_${lang})
    if(EXISTS "${_fs_dir}/${_fs_name}${_fs_suffix}")
      set(${out} "${_fs_dir}/${_fs_name}${_fs_suffix}" PARENT_SCOPE)
      return()
    endif()
  endforeach()
endfunction()

# Before the first find_package(MPI): when a wrapper was given for one language and not for
# another, use the given one's sibling (_fullshard_mpi_sibling). Without a given wrapper, or
# with one of another name (mpiicpc, Cray's CC), FindMPI searches as it does alone.
function(fullshard_mpi_pick_siblings)
  foreach(_fs_lang CXX C Fortran)
    if(DEFINED MPI_${_fs_lang}_COMPILER AND NOT _fs_model)
      set(_fs_given "${MPI_${_fs_lang}_COMPILER}")
      if(NOT IS_ABSOLUTE "${_fs_given}")  # a name (mpicxx.mpich): its path, as FindMPI finds it
        find_program(_fs_mpi_wrapper NAMES "${_fs_given}")
        set(_fs_given "${_fs_mpi_wrapper}")
        unset(_fs_mpi_wrapper CACHE)
      endif()
      if(EXISTS "${_fs_given}")
        set(_fs_model "${_fs_given}")
        set(_fs_model_lang ${_fs_lang})
      endif()
    endif()
  endforeach()
  if(NOT _fs_model)
    return()
  endif()
  set(_fs_picked "")
  foreach(_fs_lang CXX C Fortran)
    if(NOT DEFINED MPI_${_fs_lang}_COMPILER)
      _fullshard_mpi_sibling(_fs_wrapper "${_fs_model}" ${_fs_lang})
      if(_fs_wrapper)
        set(MPI_${_fs_lang}_COMPILER "${_fs_wrapper}" CACHE FILEPATH "MPI compiler for ${_fs_lang}")
        list(APPEND _fs_picked "MPI_${_fs_lang}_COMPILER ${_fs_wrapper}")
      endif()
    endif()
  endforeach()
  if(_fs_picked)
    list(JOIN _fs_picked ", " _fs_picked)
    message(STATUS "fullshard: ${_fs_picked} (the family of MPI_${_fs_model_lang}_COMPILER "
                   "${_fs_model})")
  endif()
endfunction()

# The MPI libraries (libmpi, libmpich, libmpi_usempif08: the names with "mpi") of a list of
# libraries: `out` as real paths (Debian's /usr/lib/<triplet>/libmpi.so is a link into Open
# MPI's directory), `out`_shown as given.
function(_fullshard_mpi_libraries out)
  set(_fs_libs "")
  set(_fs_shown "")
  foreach(_fs_lib IN LISTS ARGN)
    get_filename_component(_fs_name "${_fs_lib}" NAME)
    if(IS_ABSOLUTE "${_fs_lib}" AND EXISTS "${_fs_lib}" AND _fs_name MATCHES "mpi")
      list(APPEND _fs_shown "${_fs_lib}")
      get_filename_component(_fs_lib "${_fs_lib}" REALPATH)
      list(APPEND _fs_libs "${_fs_lib}")
    endif()
  endforeach()
  set(${out} "${_fs_libs}" PARENT_SCOPE)
  string(REPLACE ";" " " _fs_shown "${_fs_shown}")
  set(${out}_shown "${_fs_shown}" PARENT_SCOPE)
endfunction()

# After find_package(MPI) for every language: the MPI libraries of C (fullshard's C API) must be
# among those of C++ and of Fortran, whose wrappers link their bindings over the same C library
# (MPICH's mpif90: libmpichfort and libmpich). Otherwise stop, naming both MPIs and the option to
# set. C without MPI libraries (a compiler with MPI built in, Cray's cc) is not checked.
function(fullshard_mpi_check_same)
  if(NOT MPI_C_FOUND)
    return()
  endif()
  _fullshard_mpi_libraries(_fs_c_libs ${MPI_C_LIBRARIES})
  if(NOT _fs_c_libs)
    return()
  endif()
  foreach(_fs_lang CXX Fortran)
    if(NOT MPI_${_fs_lang}_FOUND)
      continue()
    endif()
    _fullshard_mpi_libraries(_fs_libs ${MPI_${_fs_lang}_LIBRARIES})
    set(_fs_same TRUE)
    foreach(_fs_lib IN LISTS _fs_c_libs)
      if(NOT _fs_lib IN_LIST _fs_libs)
        set(_fs_same FALSE)
      endif()
    endforeach()
    if(_fs_same)
      continue()
    endif()
    # The option to set: the other language's wrapper of C's MPI (or C's of C++'s MPI).
    if(_fs_lang STREQUAL "Fortran")
      _fullshard_mpi_sibling(_fs_wrapper "${MPI_C_COMPILER}" Fortran)
      if(NOT _fs_wrapper)
        set(_fs_wrapper "<the mpif90 of ${MPI_C_COMPILER}'s MPI>")
      endif()
      set(_fs_fix "-DMPI_Fortran_COMPILER=${_fs_wrapper}")
      set(_fs_off "-DFULLSHARD_ENABLE_FORTRAN=OFF")
    else()
      _fullshard_mpi_sibling(_fs_wrapper "${MPI_CXX_COMPILER}" C)
      if(NOT _fs_wrapper)
        set(_fs_wrapper "<the mpicc of ${MPI_CXX_COMPILER}'s MPI>")
      endif()
      set(_fs_fix "-DMPI_C_COMPILER=${_fs_wrapper}")
      set(_fs_off "-DFULLSHARD_ENABLE_C=OFF")
    endif()
    message(FATAL_ERROR
      "fullshard: C and ${_fs_lang} found different MPIs:\n"
      "  C: ${MPI_C_COMPILER} (MPI ${MPI_C_VERSION}: ${_fs_c_libs_shown})\n"
      "  ${_fs_lang}: ${MPI_${_fs_lang}_COMPILER} (MPI ${MPI_${_fs_lang}_VERSION}: "
      "${_fs_libs_shown})\n"
      "Pass ${_fs_fix} in a fresh build directory (FindMPI keeps what it found in the "
      "cache), or ${_fs_off}.")
  endforeach()
endfunction()

# MPI::MPI_Fortran's compile options are the flags of MPI's Fortran wrapper (MPICH's mpif90:
# -fallow-argument-mismatch -fallow-invalid-boz). A target that links it passes them to its C
# and C++ sources too (lib/fortran/describe.c, bench/bench_fortran_cpp.cpp), where GCC warns
# that they are valid for Fortran only: keep them to Fortran sources.
function(fullshard_mpi_fortran_options_fortran_only)
  if(NOT TARGET MPI::MPI_Fortran)
    return()
  endif()
  get_target_property(_fs_options MPI::MPI_Fortran INTERFACE_COMPILE_OPTIONS)
  if(NOT _fs_options OR _fs_options MATCHES "^\\$<\\$<COMPILE_LANGUAGE:Fortran>:")
    return()
  endif()
  set_property(TARGET MPI::MPI_Fortran PROPERTY INTERFACE_COMPILE_OPTIONS
               "$<$<COMPILE_LANGUAGE:Fortran>:${_fs_options}>")
endfunction()
