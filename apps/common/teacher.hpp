// fullshard-train's data: a fixed random teacher network, t = B tanh(A x + c), and inputs
// x ~ N(0, 1), both drawn by counter from the seed, so that sample i is the same on every rank
// and at any rank count (a run resumed on another rank count continues the same stream).
#pragma once

#include <cstdint>
#include <vector>

#include "residual_mlp.hpp"

namespace fullshard::apps {

class Teacher {
 public:
  /// The teacher of a model with `s`'s inputs and outputs, fixed by `seed`.
  Teacher(const MlpShape& s, std::uint64_t seed);

  /// Samples [first, first + rows) of the data stream: inputs (rows x inputs) and targets
  /// (rows x outputs), row-major.
  void batch(std::int64_t first, int rows, std::vector<float>& x, std::vector<float>& t) const;

 private:
  static constexpr int kWidth = 64;
  static constexpr std::uint64_t kTeacherStream = 1u << 20, kDataStream = 1u << 21;
  MlpShape s_;
  std::uint64_t seed_;
  std::vector<double> a_, b_, c_;
};

}  // namespace fullshard::apps
