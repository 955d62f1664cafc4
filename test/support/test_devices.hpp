// The devices the engine tests are instantiated on. An engine test is written once, as a
// doctest template on a device tag D (the way Cabana and Aluminum test each backend):
//
//   TEST_CASE_TEMPLATE("fully_shard: ...", D, FULLSHARD_TEST_DEVICE) {
//     auto mesh = D::mesh({W}, {"dp"});        // a mesh of the device
//     ... CHECK(p.data().space() == D::space); // where shards and gradients must live
//     const Tensor h = test::host_copy(p.grad()); // read values wherever they live
//   }
//
// A device tag provides: `name` (the instantiation's name, shown as "<test name><host>"),
// `space` (the memory the engine keeps shards, unsharded parameters and gradients in on this
// device), `unavailable()` (why the device cannot run here, "" when it can; asked before the
// Runtime starts) and `mesh(shape, names)`.
//
// One device per test program: CMake compiles each engine test source once per device
// (test/CMakeLists.txt, fullshard_add_engine_test): the host program test-<name> (CTest
// <name>.npN, as ever) and, when Kokkos has CUDA, the CUDA program test-gpu.<name> (CTest
// gpu.<name>.np1, defines FULLSHARD_TEST_DEVICE_CUDA). The CUDA program exits 77 with
// "SKIPPED: ..." where no CUDA device is visible (CTest reports it skipped).
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "fullshard/mesh/device_mesh.hpp"
#include "fullshard/tensor/tensor.hpp"
#include "test_support.hpp"

#if defined(FULLSHARD_TEST_DEVICE_CUDA)
#include <cuda_runtime_api.h>
#include <Kokkos_Core.hpp>  // KOKKOS_ENABLE_CUDA
#endif

namespace fullshard::test {

/// Host memory, host execution (Kokkos' host space), MPI communicators.
struct HostDevice {
  static constexpr const char* name = "host";
  static constexpr MemorySpace space = MemorySpace::host;
  static std::string unavailable() { return {}; }
  static DeviceMesh mesh(std::vector<int> shape, std::vector<std::string> names) {
    return DeviceMesh(runtime(), std::move(shape), std::move(names));
  }
};

#if defined(FULLSHARD_TEST_DEVICE_CUDA)
/// CUDA device memory (Kokkos' default execution space), one GPU per rank.
struct CudaDevice {
  static constexpr const char* name = "cuda";
  static constexpr MemorySpace space = MemorySpace::device;
  static std::string unavailable() {
#if !defined(KOKKOS_ENABLE_CUDA)
    return "this Kokkos has no CUDA backend (build against a CUDA-enabled Kokkos: "
           "docs/gpu.md, scripts/build-cuda)";
#else
    int devices = 0;
    const cudaError_t e = cudaGetDeviceCount(&devices);
    if (e != cudaSuccess) {
      const std::string why = cudaGetErrorString(e);
      cudaGetLastError();
      return "no CUDA device is visible (cudaGetDeviceCount: " + why + ")";
    }
    if (devices == 0) return "no CUDA device is visible (cudaGetDeviceCount: 0 devices)";
    return {};
#endif
  }
  /// A CUDA mesh (init_device_mesh("cuda", ...)): NCCL communicators, CUDA streams and the
  /// stream-ordered device pool, so the engine keeps its bytes in device memory.
  static DeviceMesh mesh(std::vector<int> shape, std::vector<std::string> names) {
    return DeviceMesh(runtime(), DeviceType::cuda, std::move(shape), std::move(names));
  }
};
#define FULLSHARD_TEST_DEVICE ::fullshard::test::CudaDevice
#else
#define FULLSHARD_TEST_DEVICE ::fullshard::test::HostDevice
#endif

/// The device of this test program (asked by the test main before the Runtime starts).
using ProgramDevice = FULLSHARD_TEST_DEVICE;

/// `t` itself when its bytes are host memory (or it has none), else a host copy: what the tests
/// read element by element. Test tensors are small; a device tensor is copied whole.
inline Tensor host_copy(const Tensor& t) {
  if (t.space() == MemorySpace::host || t.data() == nullptr) return t;
  Tensor h = Tensor::empty(t.shape(), t.dtype());
  copy_bytes(h, t);
  return h;
}

/// Every element of `t` (wherever it lives), as doubles.
inline std::vector<double> host_values(const Tensor& t) {
  const Tensor h = host_copy(t);
  std::vector<double> out(static_cast<std::size_t>(h.numel()));
  for (std::int64_t e = 0; e < h.numel(); ++e)
    out[static_cast<std::size_t>(e)] = h.at(e);
  return out;
}

/// Elements of `got` that differ from `want` (the first five reported): exactly on the host
/// (and where `exact`), else beyond 1e-6 relative (device kernels may round differently).
template <class D>
int mismatches(const std::string& what, const std::vector<double>& got,
               const std::vector<double>& want, bool exact = false) {
  const double rel = D::space == MemorySpace::host || exact ? 0.0 : 1e-6;
  int bad = got.size() == want.size() ? 0 : 1;
  for (std::size_t e = 0; e < got.size() && e < want.size(); ++e)
    if (!(std::fabs(got[e] - want[e]) <= rel * std::max(1.0, std::fabs(want[e])))) {
      if (bad < 5) MESSAGE(what << "[" << e << "]: " << got[e] << ", expected " << want[e]);
      ++bad;
    }
  return bad;
}

/// Writes `h`, a host_copy of `t` the test changed, back into `t` (nothing to do when they
/// share their bytes, as on the host).
inline void write_back(const Tensor& t, const Tensor& h) {
  if (t.data() != h.data()) copy_bytes(t, h);
}

}  // namespace fullshard::test

DOCTEST_TYPE_TO_STRING_AS("host", fullshard::test::HostDevice);
#if defined(FULLSHARD_TEST_DEVICE_CUDA)
DOCTEST_TYPE_TO_STRING_AS("cuda", fullshard::test::CudaDevice);
#endif
