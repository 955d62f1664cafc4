# LibTorch 2.x from the PyPI torch wheel (site-packages/torch), found through
# -DCMAKE_PREFIX_PATH=$(python -c 'import torch; print(torch.utils.cmake_prefix_path)') or
# -DTorch_DIR=<site-packages>/torch/share/cmake/Torch. Before find_package(NCCL) and
# find_package(Torch), fullshard_torch_wheel_hints() points the build at the wheel's own
# libraries where nothing else was given:
#
#   - c10_LIBRARY, TORCH_LIBRARY, ...: the wheel's libraries. TorchConfig.cmake looks for them
#     with find_library, which searches the system paths before its hint: where Debian's
#     libtorch-dev is also installed it takes Debian's libc10.so and libtorch.so beside the
#     wheel's headers (the program aborts at start, or does not link).
#   - NCCL_INCLUDE_DIR, NCCL_LIBRARY: the wheel's NCCL (site-packages/nvidia/nccl; the library
#     is only libnccl.so.2). The wheel's libtorch_cuda.so links it, and one process can hold
#     one NCCL: fullshard links the same one (a newer one than /usr/local/cuda's).
#   - Caffe2_DIR: the wheel's (Torch's package finds it with find_package; a system
#     LibTorch's would come first when only Torch_DIR points at the wheel).
#   - CMAKE_INSTALL_RPATH_USE_LINK_PATH: installed programs find the wheel's NCCL without
#     LD_LIBRARY_PATH.
#   - FULLSHARD_TORCH_WHEEL_LIBS: the wheel's CUDA libraries (site-packages/nvidia/*/lib),
#     which libtorch_cuda.so needs at link time (-rpath-link: they are its dependencies, not
#     the program's); fullshard_torch passes them on to its users.
#
# Sets FULLSHARD_TORCH_WHEEL (the site-packages directory) when the wheel was found, else
# leaves everything as it was (Debian's libtorch-dev, a LibTorch zip, Spack's py-torch).

function(fullshard_torch_wheel_hints)
  # Torch_DIR, when given, is the Torch CMake uses: the only candidate. Else the prefixes
  # find_package searches: <prefix>/Torch (torch.utils.cmake_prefix_path) or
  # <prefix>/share/cmake/Torch (<site-packages>/torch), from CMAKE_PREFIX_PATH, Torch_ROOT and
  # the environment's CMAKE_PREFIX_PATH (module systems set it).
  set(_candidates)
  if(Torch_DIR)
    list(APPEND _candidates "${Torch_DIR}")
  else()
    set(_prefixes ${CMAKE_PREFIX_PATH} ${Torch_ROOT})
    if(DEFINED ENV{CMAKE_PREFIX_PATH})
      string(REPLACE ":" ";" _env "$ENV{CMAKE_PREFIX_PATH}")
      list(APPEND _prefixes ${_env})
    endif()
    foreach(_p IN LISTS _prefixes)
      list(APPEND _candidates "${_p}/Torch" "${_p}/share/cmake/Torch")
    endforeach()
  endif()
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
  # Torch's package finds Caffe2's with find_package: the wheel's, not a system LibTorch's.
  if(NOT Caffe2_DIR AND EXISTS "${_site}/torch/share/cmake/Caffe2")
    set(Caffe2_DIR "${_site}/torch/share/cmake/Caffe2" CACHE PATH "Caffe2 (the torch wheel's)")
  endif()
  # Every library TorchConfig.cmake looks for with find_library (c10_LIBRARY, TORCH_LIBRARY,
  # C10_CUDA_LIBRARY, CAFFE2_NVRTC_LIBRARY, <name>_LIBRARY) is the wheel's: find_library
  # searches the system paths before Torch's hint. A value given stays; one a find left
  # NOTFOUND (an earlier configure) is replaced.
  file(GLOB _torch_libs "${_site}/torch/lib/lib*.so")
  foreach(_lib IN LISTS _torch_libs)
    get_filename_component(_name "${_lib}" NAME_WE)
    string(REGEX REPLACE "^lib" "" _name "${_name}")
    set(_vars ${_name}_LIBRARY)
    if(_name STREQUAL "torch")
      list(APPEND _vars TORCH_LIBRARY)
    elseif(_name STREQUAL "c10_cuda")
      list(APPEND _vars C10_CUDA_LIBRARY)
    elseif(_name STREQUAL "caffe2_nvrtc")
      list(APPEND _vars CAFFE2_NVRTC_LIBRARY)
    endif()
    foreach(_var IN LISTS _vars)
      if(NOT ${_var} OR ${_var} MATCHES "NOTFOUND$")
        set(${_var} "${_lib}" CACHE FILEPATH "LibTorch's ${_name} (the torch wheel's)" FORCE)
      endif()
    endforeach()
  endforeach()
  set(_nccl "${_site}/nvidia/nccl")
  if(EXISTS "${_nccl}/include/nccl.h")
    file(GLOB _nccl_libs "${_nccl}/lib/libnccl.so*")
    if(_nccl_libs AND NOT NCCL_INCLUDE_DIR AND NOT NCCL_LIBRARY AND NOT NCCL_ROOT
       AND NOT DEFINED ENV{NCCL_ROOT})
      list(SORT _nccl_libs)
      list(GET _nccl_libs 0 _nccl_lib)
      set(NCCL_INCLUDE_DIR "${_nccl}/include" CACHE PATH "nccl.h (the torch wheel's)")
      set(NCCL_LIBRARY "${_nccl_lib}" CACHE FILEPATH "libnccl (the torch wheel's)")
    endif()
  endif()
  file(GLOB _libs LIST_DIRECTORIES true "${_site}/nvidia/*/lib")
  list(SORT _libs)
  set(FULLSHARD_TORCH_WHEEL_LIBS "${_libs}" PARENT_SCOPE)
  # Installed programs and libraries keep the wheel's directories (its NCCL) in their RPATH,
  # as the build tree's do.
  if(NOT DEFINED CMAKE_INSTALL_RPATH_USE_LINK_PATH)
    set(CMAKE_INSTALL_RPATH_USE_LINK_PATH ON PARENT_SCOPE)
  endif()
  message(STATUS "LibTorch from the torch wheel in ${_site}: c10 ${c10_LIBRARY}, NCCL "
                 "${NCCL_LIBRARY}")
endfunction()
