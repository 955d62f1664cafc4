// How a tensor is laid out over the ranks of one mesh dim.
#pragma once

#include <string>

namespace fullshard {

class Placement {
 public:
  /// Chunked along `dim` (torch.chunk rules on dim 0; even split required on other dims).
  static Placement Shard(int dim = 0) { return Placement(dim); }
  /// A full copy on every rank.
  static Placement Replicate() { return Placement(-1); }

  bool is_shard() const noexcept { return dim_ >= 0; }
  bool is_replicate() const noexcept { return dim_ < 0; }
  /// The sharded dim (only for is_shard()).
  int dim() const noexcept { return dim_; }
  /// "Shard(0)" or "Replicate()".
  std::string to_string() const {
    return is_shard() ? "Shard(" + std::to_string(dim_) + ")" : "Replicate()";
  }
  bool operator==(const Placement& o) const noexcept { return dim_ == o.dim_; }
  bool operator!=(const Placement& o) const noexcept { return dim_ != o.dim_; }

 private:
  explicit Placement(int dim) : dim_(dim) {}
  int dim_;
};

}  // namespace fullshard
