# Finding Kokkos, in one place for the build and for the installed package config.
#
# Debian's Kokkos 3.4 (libtrilinos-kokkos-dev) exports a Kokkos::kokkos target whose include
# directory is /usr/lib/include, which does not exist; the right one is in Kokkos_INCLUDE_DIRS
# (/usr/include/trilinos). fullshard_repair_kokkos() replaces a non-existent literal include
# directory with Kokkos_INCLUDE_DIRS and leaves a healthy target (Kokkos 4.x) untouched.

function(fullshard_repair_kokkos)
  if(NOT TARGET Kokkos::kokkos OR NOT Kokkos_INCLUDE_DIRS)
    return()
  endif()
  get_target_property(_fs_aliased Kokkos::kokkos ALIASED_TARGET)
  set(_fs_target Kokkos::kokkos)
  if(_fs_aliased)
    set(_fs_target ${_fs_aliased})
  endif()
  get_target_property(_fs_dirs ${_fs_target} INTERFACE_INCLUDE_DIRECTORIES)
  if(NOT _fs_dirs)
    return()
  endif()
  set(_fs_broken FALSE)
  foreach(_fs_dir IN LISTS _fs_dirs)
    if(NOT _fs_dir MATCHES "\\$<" AND NOT IS_DIRECTORY "${_fs_dir}")
      set(_fs_broken TRUE)
    endif()
  endforeach()
  if(_fs_broken)
    message(STATUS "fullshard: repairing Kokkos::kokkos include directory "
                   "(${_fs_dirs} -> ${Kokkos_INCLUDE_DIRS})")
    set_target_properties(${_fs_target} PROPERTIES INTERFACE_INCLUDE_DIRECTORIES
                                                   "${Kokkos_INCLUDE_DIRS}")
  endif()
endfunction()

# Kokkos_VERSION "3.4.01" / "4.6.1" -> 30401 / 40601 (the KOKKOS_VERSION macro's form).
function(fullshard_kokkos_version_number out)
  string(REPLACE "." ";" _fs_parts "${Kokkos_VERSION}")
  list(LENGTH _fs_parts _fs_n)
  set(_fs_num 0)
  foreach(_fs_i RANGE 0 2)
    set(_fs_p 0)
    if(_fs_i LESS _fs_n)
      list(GET _fs_parts ${_fs_i} _fs_p)
      math(EXPR _fs_p "${_fs_p} + 0")
    endif()
    math(EXPR _fs_num "${_fs_num} * 100 + ${_fs_p}")
  endforeach()
  set(${out} ${_fs_num} PARENT_SCOPE)
endfunction()

# TRUE when the Kokkos found has the CUDA backend (Kokkos_DEVICES lists CUDA; Kokkos 4 also
# answers kokkos_check).
function(fullshard_kokkos_has_cuda out)
  set(_fs_has FALSE)
  if("CUDA" IN_LIST Kokkos_DEVICES OR Kokkos_ENABLE_CUDA)
    set(_fs_has TRUE)
  endif()
  set(${out} ${_fs_has} PARENT_SCOPE)
endfunction()
