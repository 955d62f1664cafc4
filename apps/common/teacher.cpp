#include "teacher.hpp"

#include <cmath>
#include <cstddef>

namespace fullshard::apps {

Teacher::Teacher(const MlpShape& s, std::uint64_t seed) : s_(s), seed_(seed) {
  const int T = kWidth, I = s.inputs, O = s.outputs;
  a_.resize(static_cast<std::size_t>(T) * I);
  b_.resize(static_cast<std::size_t>(O) * T);
  c_.resize(T);
  for (std::size_t e = 0; e < a_.size(); ++e)
    a_[e] = normal01(seed, kTeacherStream, e) / std::sqrt(double(I));
  for (std::size_t e = 0; e < b_.size(); ++e)
    b_[e] = normal01(seed, kTeacherStream + 1, e) / std::sqrt(double(T));
  for (int e = 0; e < T; ++e)
    c_[e] = uniform01(seed, kTeacherStream + 2, static_cast<std::uint64_t>(e)) - 0.5;
}

void Teacher::batch(std::int64_t first, int rows, std::vector<float>& x,
                    std::vector<float>& t) const {
  const int T = kWidth, I = s_.inputs, O = s_.outputs;
  x.resize(static_cast<std::size_t>(rows) * I);
  t.resize(static_cast<std::size_t>(rows) * O);
  std::vector<double> xi(I), hid(T);
  for (int r = 0; r < rows; ++r) {
    const auto sample = static_cast<std::uint64_t>(first + r);
    for (int i = 0; i < I; ++i) {
      xi[i] = normal01(seed_, kDataStream, sample * I + i);
      x[static_cast<std::size_t>(r) * I + i] = static_cast<float>(xi[i]);
    }
    for (int j = 0; j < T; ++j) {
      double acc = c_[j];
      for (int i = 0; i < I; ++i)
        acc += a_[static_cast<std::size_t>(j) * I + i] * xi[i];
      hid[j] = std::tanh(acc);
    }
    for (int o = 0; o < O; ++o) {
      double acc = 0;
      for (int j = 0; j < T; ++j)
        acc += b_[static_cast<std::size_t>(o) * T + j] * hid[j];
      t[static_cast<std::size_t>(r) * O + o] = static_cast<float>(acc);
    }
  }
}

}  // namespace fullshard::apps
