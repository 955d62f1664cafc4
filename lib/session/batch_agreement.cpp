#include "lib/session/batch_agreement.hpp"

#include <c10/core/ScalarType.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>

#include "fullshard/base/error.hpp"
#include "lib/base/hash.hpp"
#include "lib/kernels/finite_scan.hpp"

namespace fullshard::session::detail {

namespace {

std::string dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "f32";
    case at::kDouble:
      return "f64";
    case at::kHalf:
      return "f16";
    case at::kBFloat16:
      return "bf16";
    case at::kInt:
      return "i32";
    case at::kLong:
      return "i64";
    default:
      return c10::toString(t);
  }
}

void describe(std::string& out, const std::vector<at::Tensor>& ts, const char* what) {
  for (std::size_t i = 0; i < ts.size(); ++i) {
    const at::Tensor& t = ts[i];
    out += (out.empty() ? "" : "; ") + std::string(what) + "[" + std::to_string(i) + "] " +
           dtype_of(t.scalar_type()) + " (";
    for (std::int64_t d = 0; d < t.dim(); ++d)
      out += (d ? ", " : "") + (d == 0 ? std::string("*") : std::to_string(t.size(d)));
    out += ")";
  }
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i == 6 && ranks.size() > 7) return s + ", ... (" + std::to_string(ranks.size()) + ")";
    s += (i ? ", " : "") + std::to_string(ranks[i]);
  }
  return s;
}

}  // namespace

std::string describe_batch(const std::vector<at::Tensor>& inputs,
                           const std::vector<at::Tensor>& targets) {
  std::string out;
  describe(out, inputs, "inputs");
  describe(out, targets, "targets");
  return out.empty() ? "no tensors" : out;
}

std::string non_finite_in(const std::vector<at::Tensor>& tensors, const char* what) {
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (!at::isFloatingType(t.scalar_type()) || t.numel() == 0) continue;
    std::int64_t at_element = -1;
    double value = 0;
    if (t.device().is_cpu() && t.is_contiguous() &&
        (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble)) {
      // One pass, no allocation: the common case (host arrays, the C API's).
      if (t.scalar_type() == at::kFloat)
        at_element = kernels::first_non_finite(t.data_ptr<float>(), t.numel());
      else
        at_element = kernels::first_non_finite(t.data_ptr<double>(), t.numel());
      if (at_element >= 0) value = t.reshape({-1})[at_element].item<double>();
    } else if (!at::isfinite(t).all().item<bool>()) {
      const at::Tensor flat = t.reshape({-1});
      at_element = at::logical_not(at::isfinite(flat)).nonzero()[0][0].item<std::int64_t>();
      value = flat[at_element].item<double>();
    }
    if (at_element < 0) continue;
    std::string where = "[";
    for (std::int64_t d = t.dim() - 1, rest = at_element; d >= 0; --d) {
      where.insert(1, std::to_string(rest % t.size(d)) + (d + 1 < t.dim() ? ", " : ""));
      rest /= t.size(d);
    }
    return std::string(what) + " " + std::to_string(i) + " holds " +
           (std::isnan(value) ? "nan"
            : value > 0       ? "inf"
                              : "-inf") +
           " at " + where + "]";
  }
  return {};
}

std::string agree_on_batch(BoundedComm& comm, const std::string& description,
                           const std::string& call, const std::string& bad_data) {
  if (comm.size() == 1) return bad_data.empty() ? std::string() : "rank 0: " + bad_data;
  const std::uint64_t h = fnv1a64(description);
  // The max of each: the max and the min of h, and the lowest rank with bad data (size - rank).
  std::uint64_t v[3] = {h, ~h, bad_data.empty() ? 0 : std::uint64_t(comm.size() - comm.rank())};
  comm.allreduce(v, 3, MPI_UINT64_T, MPI_MAX, "batch agreement (MPI_Iallreduce)");
  if (v[0] == h && ~v[1] == h) {
    if (v[2] == 0) return {};
    const int bad_rank = comm.size() - int(v[2]);
    std::string msg = bad_data;
    comm.bcast(msg, bad_rank, "batch agreement (MPI_Ibcast)");
    return "rank " + std::to_string(bad_rank) + ": " + msg;
  }
  // A difference: every rank's description to every rank (the error path only).
  std::map<std::string, std::vector<int>> by_batch;
  for (int r = 0; r < comm.size(); ++r) {
    std::string d = r == comm.rank() ? description : std::string();
    comm.bcast(d, r, "batch agreement (MPI_Ibcast)");
    by_batch[d].push_back(r);
  }
  // The largest set first: the odd ones out are the others.
  std::vector<std::pair<std::vector<int>, std::string>> sets;
  for (auto& [d, ranks] : by_batch)
    sets.emplace_back(ranks, d);
  std::stable_sort(sets.begin(), sets.end(),
                   [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  std::string msg = call +
                    ": the ranks' batches differ (every rank's batch must have the same shape "
                    "except the first dim, and the same dtypes): ";
  for (std::size_t i = 0; i < sets.size(); ++i) {
    if (i == 8) {
      msg += " | ... (" + std::to_string(sets.size()) + " different batches)";
      break;
    }
    msg += (i ? " | " : "") + rank_list(sets[i].first) + ": " + sets[i].second;
  }
  throw InvalidArgument(msg);
}

}  // namespace fullshard::session::detail
