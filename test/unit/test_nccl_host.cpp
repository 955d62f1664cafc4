// Host-side parts of the NCCL backend: error messages, checks, and the MPI bootstrap of the
// unique id. Nothing here needs a GPU; the one GPU case skips itself without a device.
#include <cuda_runtime.h>
#include <doctest/doctest.h>
#include <mpi.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>

#include "fullshard/base/error.hpp"
#include "lib/comm/nccl/nccl_error.hpp"
#include "lib/comm/nccl/nccl_poll.hpp"
#include "lib/comm/nccl/nccl_types.hpp"
#include "lib/comm/nccl_communicator.hpp"

using fullshard::CommError;
using fullshard::comm::nccl_check;
using fullshard::comm::nccl_error_message;
using fullshard::comm::NcclCommunicator;
using fullshard::comm::NcclUniqueId;

namespace {

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

std::uint64_t fnv1a(const NcclUniqueId& id) {
  std::uint64_t h = 1469598103934665603ull;
  for (char c : id.bytes) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return h;
}

// MIN == MAX of `v` over the world.
bool same_on_all_ranks(std::uint64_t v) {
  std::uint64_t lo = 0;
  std::uint64_t hi = 0;
  MPI_Allreduce(&v, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&v, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  return lo == hi;
}

}  // namespace

TEST_CASE("nccl_error_message names the result and gives a hint") {
  struct Case {
    ncclResult_t r;
    const char* name;
    const char* hint;
  };
  const Case cases[] = {
      {ncclUnhandledCudaError, "ncclUnhandledCudaError", "a CUDA call failed (no GPU"},
      {ncclSystemError, "ncclSystemError", "system call failed"},
      {ncclInternalError, "ncclInternalError", "internal NCCL error"},
      {ncclInvalidArgument, "ncclInvalidArgument", "bad argument"},
      {ncclInvalidUsage, "ncclInvalidUsage", "used incorrectly"},
      {ncclRemoteError, "ncclRemoteError", "another rank failed or left"},
      {ncclInProgress, "ncclInProgress", "non-blocking operation still in progress"},
  };
  for (const Case& c : cases) {
    const std::string m = nccl_error_message(c.r, "ncclAllReduce");
    INFO(m);
    CHECK(contains(m, c.name));
    CHECK(contains(m, c.hint));
    CHECK(contains(m, ncclGetErrorString(c.r)));
  }
  const std::string unknown = nccl_error_message(static_cast<ncclResult_t>(99), "x");
  CHECK(contains(unknown, "ncclResult_t(99)"));
}

TEST_CASE("nccl_check throws CommError with context and call, except on success") {
  CHECK_NOTHROW(nccl_check(ncclSuccess, "ncclAllReduce", "ctx"));
  try {
    nccl_check(ncclRemoteError, "ncclAllGather", "all_gather on communicator 'dp' (rank 0/2)");
    FAIL("nccl_check did not throw");
  } catch (const CommError& e) {
    const std::string m = e.what();
    INFO(m);
    CHECK(contains(m, "all_gather on communicator 'dp' (rank 0/2): ncclAllGather failed: "));
    CHECK(contains(m, "ncclRemoteError"));
    CHECK(contains(m, "another rank failed or left"));
  }
  // ncclInProgress: an error for blocking calls, success when the caller opts in.
  CHECK_THROWS_AS(nccl_check(ncclInProgress, "ncclCommInitRankConfig", "ctx"), CommError);
  CHECK_NOTHROW(nccl_check(ncclInProgress, "ncclCommInitRankConfig", "ctx", true));
  CHECK_THROWS_AS(nccl_check(ncclSystemError, "ncclCommInitRankConfig", "ctx", true), CommError);
}

TEST_CASE("nccl_bootstrap_id gives every rank the same id, or every rank the same error") {
  int outcome = 0;  // 1: id, 2: CommError naming ncclGetUniqueId, 3: anything else
  std::uint64_t hash = 0;
  bool nonzero = false;
  std::string error;
  try {
    const NcclUniqueId id = fullshard::comm::nccl_bootstrap_id(MPI_COMM_WORLD, "world");
    outcome = 1;
    hash = fnv1a(id);
    for (char c : id.bytes)
      nonzero = nonzero || c != 0;
  } catch (const CommError& e) {
    error = e.what();
    outcome = contains(error, "ncclGetUniqueId") ? 2 : 3;
  }
  INFO(error);
  CHECK(outcome != 3);
  REQUIRE(same_on_all_ranks(static_cast<std::uint64_t>(outcome)));
  if (outcome == 1) {
    MESSAGE("ncclGetUniqueId worked here: every rank got the same 128-byte id");
    CHECK(nonzero);
    CHECK(same_on_all_ranks(hash));
    // A second id differs from the first (fresh bootstrap address/magic).
    const NcclUniqueId again = fullshard::comm::nccl_bootstrap_id(MPI_COMM_WORLD, "world");
    CHECK(same_on_all_ranks(fnv1a(again)));
    CHECK(fnv1a(again) != hash);
  } else if (outcome == 2) {
    MESSAGE("ncclGetUniqueId failed here, and every rank got the CommError: " << error);
  }
}

TEST_CASE("NcclCommunicator on the current device (GPU only)") {
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  int have = (e == cudaSuccess && devices > 0) ? 1 : 0;
  int all = 0;
  MPI_Allreduce(&have, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!all) {
    MESSAGE("skipped: no CUDA device on some rank (cudaGetDeviceCount: "
            << std::string(cudaGetErrorString(e)) << ", " << devices << " devices)");
    return;
  }
  int rank = 0;
  int size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  auto comm = NcclCommunicator::create(MPI_COMM_WORLD, "nccl.world", 60.0);
  CHECK(comm->rank() == rank);
  CHECK(comm->size() == size);
  CHECK(comm->name() == "nccl.world");
}

TEST_CASE("fullshard dtypes and reduce ops map to NCCL's") {
  using fullshard::DType;
  using fullshard::comm::nccl_dtype;
  using fullshard::comm::nccl_op;
  using fullshard::comm::ReduceOp;
  CHECK(nccl_dtype(DType::f32) == ncclFloat32);
  CHECK(nccl_dtype(DType::f64) == ncclFloat64);
  CHECK(nccl_dtype(DType::f16) == ncclFloat16);
  CHECK(nccl_dtype(DType::bf16) == ncclBfloat16);
  CHECK_THROWS_AS(nccl_dtype(static_cast<DType>(9)), fullshard::InvalidArgument);
  bool native = true;
  CHECK(nccl_op(ReduceOp::sum, &native) == ncclSum);
  CHECK_FALSE(native);
  CHECK(nccl_op(ReduceOp::max) == ncclMax);
  CHECK(nccl_op(ReduceOp::min) == ncclMin);
  // NCCL 2.10+ averages natively; older versions get sum plus a divide kernel.
  const ncclRedOp_t avg = nccl_op(ReduceOp::avg, &native);
  if (NCCL_VERSION_CODE >= NCCL_VERSION(2, 10, 0)) {
    CHECK(native);
    CHECK(avg == ncclAvg);
  } else {
    CHECK_FALSE(native);
    CHECK(avg == ncclSum);
  }
}

TEST_CASE("the pre-mul-sum scalar is one element of the buffer's dtype") {
  using fullshard::DType;
  using fullshard::comm::nccl_scalar;
  auto f32 = nccl_scalar(DType::f32, 1.0 / 3.0);
  float f = 0;
  std::memcpy(&f, f32.data(), 4);
  CHECK(f == static_cast<float>(1.0 / 3.0));
  auto f64 = nccl_scalar(DType::f64, 0.125);
  double d = 0;
  std::memcpy(&d, f64.data(), 8);
  CHECK(d == 0.125);
  std::uint16_t h = 0;
  std::memcpy(&h, nccl_scalar(DType::f16, 0.25).data(), 2);
  CHECK(h == 0x3400);  // 0.25 in binary16
  std::memcpy(&h, nccl_scalar(DType::bf16, 0.5).data(), 2);
  CHECK(h == 0x3f00);  // 0.5 in bfloat16
  // 1/3 rounds to the nearest bfloat16 (0x3eab = 0.333984375).
  std::memcpy(&h, nccl_scalar(DType::bf16, 1.0 / 3.0).data(), 2);
  CHECK(h == 0x3eab);
}

TEST_CASE("NcclGroup nests and ends once (no operations, no GPU needed)") {
  using fullshard::comm::NcclGroup;
  CHECK(NcclGroup::depth() == 0);
  {
    NcclGroup outer;
    CHECK(NcclGroup::depth() == 1);
    {
      NcclGroup inner;
      CHECK(NcclGroup::depth() == 2);
      inner.end();
      CHECK(NcclGroup::depth() == 1);
      inner.end();  // a second end is a no-op
      CHECK(NcclGroup::depth() == 1);
    }
    NcclGroup moved(std::move(outer));
    CHECK(NcclGroup::depth() == 1);
  }  // the moved-to guard ends the group once
  CHECK(NcclGroup::depth() == 0);
}

namespace {

// A fake communicator state for complete_nccl_call: ncclInProgress for `polls_in_progress`
// queries (forever when negative), then `final_state`.
struct FakeInit {
  int polls_in_progress = 0;
  ncclResult_t final_state = ncclSuccess;
  int polls = 0;
  int aborts = 0;
  std::string abort_reason;

  ncclResult_t state() {
    ++polls;
    return polls_in_progress < 0 || polls <= polls_in_progress ? ncclInProgress : final_state;
  }
  // Runs complete_nccl_call as the backend does for an init; "" or the CommError's message.
  std::string run(ncclResult_t first, double timeout_s) {
    fullshard::WaitSite site{
        "ncclCommInitRankConfig", "communicator 'mesh.dp.all_gather.nccl'", 1, 4, 0, ""};
    fullshard::BackOff::Policy fast;
    fast.spins = 2;
    fast.yields = 2;
    fast.max_sleep = std::chrono::microseconds(200);
    try {
      fullshard::comm::complete_nccl_call(
          first, site, timeout_s, [this] { return state(); },
          [this](const std::string& why) {
            ++aborts;
            abort_reason = why;
          },
          fullshard::comm::kNcclInitTimeoutHint, fast);
    } catch (const CommError& e) {
      return e.what();
    }
    return "";
  }
};

}  // namespace

TEST_CASE("a non-blocking NCCL call is polled until it leaves ncclInProgress") {
  SUBCASE("success at once: no poll, no abort") {
    FakeInit f;
    CHECK(f.run(ncclSuccess, 1.0).empty());
    CHECK(f.polls == 0);
    CHECK(f.aborts == 0);
  }
  SUBCASE("in progress, then success") {
    FakeInit f;
    f.polls_in_progress = 25;
    CHECK(f.run(ncclInProgress, 0.0).empty());  // no timeout: polls until done
    CHECK(f.polls == 26);
    CHECK(f.aborts == 0);
  }
  SUBCASE("in progress, then an error: aborted, CommError naming rank and communicator") {
    FakeInit f;
    f.polls_in_progress = 3;
    f.final_state = ncclRemoteError;
    const std::string m = f.run(ncclInProgress, 5.0);
    INFO(m);
    CHECK(f.polls == 4);
    CHECK(f.aborts == 1);
    CHECK(contains(m,
                   "ncclCommInitRankConfig on communicator 'mesh.dp.all_gather.nccl' "
                   "(rank 1/4) failed: ncclRemoteError"));
    CHECK(contains(m, "another rank failed or left"));
    CHECK(contains(m, "the communicator was aborted (ncclCommAbort)"));
    CHECK(contains(f.abort_reason, "ncclRemoteError"));
  }
  SUBCASE("an error at once: aborted without polling") {
    FakeInit f;
    const std::string m = f.run(ncclSystemError, 5.0);
    INFO(m);
    CHECK(f.polls == 0);
    CHECK(f.aborts == 1);
    CHECK(contains(m, "(rank 1/4) failed: ncclSystemError"));
  }
  SUBCASE("still in progress at the timeout: aborted once, the common timeout message") {
    FakeInit f;
    f.polls_in_progress = -1;
    const std::string m = f.run(ncclInProgress, 0.05);
    INFO(m);
    CHECK(f.polls > 1);
    CHECK(f.aborts == 1);
    CHECK(contains(m,
                   "ncclCommInitRankConfig on communicator 'mesh.dp.all_gather.nccl' "
                   "(rank 1/4) did not finish within FULLSHARD_TIMEOUT=0.05 s; another rank "
                   "of the communicator did not join its creation"));
    CHECK(contains(m, "the communicator was aborted (ncclCommAbort)"));
    CHECK(f.abort_reason == m.substr(m.find("ncclCommInitRankConfig"), f.abort_reason.size()));
  }
  SUBCASE("the sequence number of an operation is part of the message") {
    fullshard::WaitSite site{"ncclAllGather", "communicator 'dp'", 0, 2, 7, "1024 x f32"};
    int aborts = 0;
    try {
      fullshard::comm::complete_nccl_call(
          ncclInProgress, site, 0.01, [] { return ncclInProgress; },
          [&](const std::string&) { ++aborts; });
      FAIL("no timeout");
    } catch (const CommError& e) {
      INFO(e.what());
      CHECK(contains(e.what(),
                     "ncclAllGather on communicator 'dp' (rank 0/2, seq 7, 1024 x f32) "
                     "did not finish within FULLSHARD_TIMEOUT=0.01 s"));
    }
    CHECK(aborts == 1);
  }
}
