# LibTorch 2.x from the PyPI torch wheel (site-packages/torch), found through
# -DCMAKE_PREFIX_PATH=$(python -c 'import torch; print(torch.utils.cmake_prefix_path)') or
# -DTorch_DIR=<site-packages>/torch/share/cmake/Torch. Before find_package(NCCL) and
# find_package(Torch), fullshard_torch_wheel_hints() points the build at the wheel's own
# libraries where nothing else was given:
#
#   - c10_LIBRARY: the wheel's libc10.so. TorchConfig.cmake looks for c10 with find_library,
#     which searches the system paths before its hint: where Debian's libtorch-dev is also
#     installed it takes Debian's libc10.so, and the program aborts at start (two c10s).
#   - NCCL_INCLUDE_DIR, NCCL_LIBRARY: the wheel's NCCL (site-packages/nvidia/nccl; the library
#     is only libnccl.so.2). The wheel's libtorch_cuda.so links it, and one process can hold
#     one NCCL: fullshard links the same one (a newer one than /usr/local/cuda's).
#   - FULLSHARD_TORCH_WHEEL_LIBS: the wheel's CUDA libraries (site-packages/nvidia/*/lib),
#     which libtorch_cuda.so needs at link time (-rpath-link: they are its dependencies, not
#     the program's); fullshard_torch passes them on to its users.
#
# Sets FULLSHARD_TORCH_WHEEL (the site-packages directory) when the wheel was found, else
# leaves everything as it was (Debian's libtorch-dev, a LibTorch zip, Spack's py-torch).

function(fullshard_torch_wheel_hints)
  set(_candidates)
  if(Torch_DIR)
    list(APPEND _candidates "${Torch_DIR}")
  endif()
  foreach(_p IN LISTS CMAKE_PREFIX_PATH)
    list(APPEND _candidates "${_p}/Torch")
  endforeach()
  set(_site "")
  foreach(_dir IN LISTS _candidates)
    get_filename_component(_dir "${_dir}" ABSOLUTE)
    # <site>/torch/share/cmake/Torch
    if(EXISTS "${_dir}/TorchConfig.cmake" AND _dir MATCHES "^(.*)/torch/share/cmake/Torch/?$")
      set(_site "${CMAKE_MATCH_1}")
      break()
    endif()
  endforeach()
  if(_site STREQUAL "" OR NOT EXISTS "${_site}/torch/lib")
    return()
  endif()
  set(FULLSHARD_TORCH_WHEEL "${_site}" PARENT_SCOPE)
  if(NOT c10_LIBRARY AND EXISTS "${_site}/torch/lib/libc10.so")
    set(c10_LIBRARY "${_site}/torch/lib/libc10.so" CACHE FILEPATH
        "LibTorch's c10 library (the torch wheel's: FullshardTorchWheel.cmake)")
  endif()
  set(_nccl "${_site}/nvidia/nccl")
  if(EXISTS "${_nccl}/include/nccl.h")
    file(GLOB _nccl_libs "${_nccl}/lib/libnccl.so*")
    if(_nccl_libs AND NOT NCCL_INCLUDE_DIR AND NOT NCCL_LIBRARY)
      list(SORT _nccl_libs)
      list(GET _nccl_libs 0 _nccl_lib)
      set(NCCL_INCLUDE_DIR "${_nccl}/include" CACHE PATH "nccl.h (the torch wheel's)")
      set(NCCL_LIBRARY "${_nccl_lib}" CACHE FILEPATH "libnccl (the torch wheel's)")
    endif()
  endif()
  file(GLOB _libs LIST_DIRECTORIES true "${_site}/nvidia/*/lib")
  list(SORT _libs)
  set(FULLSHARD_TORCH_WHEEL_LIBS "${_libs}" PARENT_SCOPE)
  message(STATUS "LibTorch from the torch wheel in ${_site}: c10 ${c10_LIBRARY}, NCCL "
                 "${NCCL_LIBRARY}")
endfunction()
