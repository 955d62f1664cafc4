// The optimizers' element updates fused with the reduction's last pass (the optimizer inside
// backward): reduce_update and reduce_sources_update must give the bits of the two passes they
// replace, the reduction storing f32 gradients and apply_update reading them, for every rule,
// source dtype and divisor, on the host loops and on the device kernel (which runs on the host
// here: the code a GPU build runs).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "error_check.hpp"
#include "fullshard/base/dtype.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/kernels/element_update.hpp"
#include "lib/kernels/multi_source.hpp"
#include "test_support.hpp"

using namespace fullshard;
using namespace fullshard::kernels;

namespace {

constexpr std::int64_t kN = 5000;  // more than two host blocks of the fused loops

// Elements of `t` from doubles, as raw bytes.
std::vector<std::uint64_t> make(DType t, std::int64_t n, int salt) {
  std::vector<std::uint64_t> words(static_cast<std::size_t>(n));  // 8 bytes per element: enough
  for (std::int64_t i = 0; i < n; ++i)
    store_from_double(words.data(), t, static_cast<std::size_t>(i),
                      test::sample(salt, static_cast<std::size_t>(i), 7, false));
  return words;
}

// The optimizer state of one update: parameters and up to two state arrays.
struct Arrays {
  std::vector<float> param, s0, s1;
  explicit Arrays(std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i) {
      const auto e = static_cast<std::size_t>(i);
      param.push_back(static_cast<float>(test::sample(1, e, 2, false)));
      s0.push_back(static_cast<float>(test::sample(2, e, 3, false)));
      s1.push_back(static_cast<float>(0.1 + std::abs(test::sample(3, e, 4, false))));
    }
  }
  ElementUpdate bind(ElementUpdate u) {
    u.param = param.data();
    u.state0 = u.state_arrays() > 0 ? s0.data() : nullptr;
    u.state1 = u.state_arrays() > 1 ? s1.data() : nullptr;
    return u;
  }
  bool operator==(const Arrays& o) const {
    return param == o.param && s0 == o.s0 && s1 == o.s1;  // bitwise for finite values
  }
};

std::vector<std::pair<std::string, ElementUpdate>> rules() {
  std::vector<std::pair<std::string, ElementUpdate>> out;
  ElementUpdate sgd;
  sgd.lr = 0.05;
  sgd.weight_decay = 0.01;
  out.emplace_back("sgd", sgd);
  ElementUpdate momentum = sgd;
  momentum.momentum = 0.9;
  momentum.fresh = true;
  out.emplace_back("sgd momentum, first step", momentum);
  momentum.fresh = false;
  momentum.nesterov = true;
  out.emplace_back("sgd nesterov", momentum);
  ElementUpdate adamw;
  adamw.rule = ElementUpdate::Rule::adamw;
  adamw.lr = 0.01;
  adamw.weight_decay = 0.05;
  adamw.beta1 = 0.9;
  adamw.beta2 = 0.99;
  adamw.eps = 1e-8;
  adamw.step_size = 0.01 / (1 - 0.9 * 0.9);
  adamw.bc2_sqrt = std::sqrt(1 - 0.99 * 0.99);
  out.emplace_back("adamw", adamw);
  return out;
}

const char* target_name(const ExecStream& on) {
  return on.target() == ExecTarget::host ? "host" : "device kernel";
}

}  // namespace

TEST_CASE("reduce_update gives the bits of reduce_copy_out then apply_update") {
  for (const ExecStream& on : {ExecStream::host(), ExecStream::device()})
    for (DType st : {DType::f32, DType::bf16, DType::f16, DType::f64})
      for (double divisor : {1.0, 3.0})
        for (const auto& named : rules()) {
          const ElementUpdate& rule = named.second;  // (no structured bindings: INFO captures)
          INFO(target_name(on), " ", dtype_name(st), " divisor ", divisor, " ", named.first);
          const std::vector<std::uint64_t> src = make(st, kN, 5);
          Arrays two_pass(kN), fused(kN);
          std::vector<float> grads(static_cast<std::size_t>(kN));
          reduce_copy_out(on, src.data(), st, grads.data(), DType::f32, kN, divisor, false);
          apply_update(on, two_pass.bind(rule), grads.data(), kN);
          reduce_update(on, src.data(), st, kN, divisor, fused.bind(rule));
          on.fence();
          CHECK(fused == two_pass);
          CHECK(fused.param != Arrays(kN).param);  // it updated something
        }
}

TEST_CASE("reduce_sources_update gives the bits of reduce_sources then apply_update") {
  const std::pair<DType, DType> pairs[] = {{DType::f32, DType::f32},
                                           {DType::bf16, DType::f32},
                                           {DType::f32, DType::bf16},
                                           {DType::f64, DType::f64}};
  for (const auto& pair : pairs)
    for (int nsrc : {1, 3})
      for (double divisor : {1.0, 3.0})
        for (const auto& named : rules()) {
          const DType pt = pair.first, rt = pair.second;
          const ElementUpdate& rule = named.second;
          INFO(dtype_name(pt), " summed in ", dtype_name(rt), ", ", nsrc, " sources, divisor ",
               divisor, " ", named.first);
          std::vector<std::vector<std::uint64_t>> sources;
          std::vector<const void*> srcs;
          for (int q = 0; q < nsrc; ++q)
            sources.push_back(make(pt, kN, 10 + q));
          for (const auto& s : sources)
            srcs.push_back(s.data());
          Arrays two_pass(kN), fused(kN);
          std::vector<float> grads(static_cast<std::size_t>(kN));
          reduce_sources(srcs.data(), nsrc, pt, rt, grads.data(), DType::f32, kN, divisor, false);
          apply_update(ExecStream::host(), two_pass.bind(rule), grads.data(), kN);
          reduce_sources_update(srcs.data(), nsrc, pt, rt, kN, divisor, fused.bind(rule));
          CHECK(fused == two_pass);
        }
}

TEST_CASE("ElementUpdate::at: the update of a range is the whole update's range") {
  const ElementUpdate adamw = rules().back().second;
  Arrays whole(kN), parts(kN);
  const std::vector<std::uint64_t> src = make(DType::f32, kN, 5);
  const ExecStream on = ExecStream::host();
  reduce_update(on, src.data(), DType::f32, kN, 2.0, whole.bind(adamw));
  const ElementUpdate u = parts.bind(adamw);
  const auto* f = reinterpret_cast<const float*>(src.data());
  reduce_update(on, f, DType::f32, 1234, 2.0, u);
  reduce_update(on, f + 1234, DType::f32, kN - 1234, 2.0, u.at(1234));
  CHECK(parts == whole);
}

TEST_CASE("apply_update without a gradient updates with zeros (a shard's padding)") {
  for (const ExecStream& on : {ExecStream::host(), ExecStream::device()})
    for (const auto& named : rules()) {
      const ElementUpdate& rule = named.second;
      INFO(target_name(on), " ", named.first);
      Arrays zeros(kN), none(kN);
      const std::vector<float> zero(static_cast<std::size_t>(kN), 0.0f);
      apply_update(on, zeros.bind(rule), zero.data(), kN);
      apply_update(on, none.bind(rule), nullptr, kN);
      on.fence();
      CHECK(none == zeros);
    }
}

TEST_CASE("the fused updates refuse bad arguments, naming the kernel") {
  using test::contains;
  using test::error_of;
  Arrays a(4);
  ElementUpdate momentum;
  momentum.momentum = 0.9;
  const float src[4] = {1, 2, 3, 4};
  const ExecStream on = ExecStream::host();
  const ElementUpdate bound = a.bind(momentum);
  CHECK(contains(
      error_of<InvalidArgument>([&] { reduce_update(on, src, DType::f32, -1, 1.0, bound); }),
      "reduce_update: negative count -1"));
  CHECK(contains(
      error_of<InvalidArgument>([&] { reduce_update(on, nullptr, DType::f32, 4, 1.0, bound); }),
      "reduce_update: null source"));
  CHECK(contains(
      error_of<InvalidArgument>([&] { reduce_update(on, src, DType::f32, 4, 0.0, bound); }),
      "divisor"));
  ElementUpdate no_state = bound;
  no_state.state0 = nullptr;
  CHECK(contains(
      error_of<InvalidArgument>([&] { reduce_update(on, src, DType::f32, 4, 1.0, no_state); }),
      "reduce_update: null parameter or state array"));
  const void* srcs[1] = {src};
  CHECK(contains(error_of<InvalidArgument>([&] {
                   reduce_sources_update(srcs, 1, DType::f32, DType::f32, 4, 1.0, no_state);
                 }),
                 "reduce_sources_update: null parameter or state array"));
  const void* none[1] = {nullptr};
  CHECK(contains(error_of<InvalidArgument>([&] {
                   reduce_sources_update(none, 1, DType::f32, DType::f32, 4, 1.0, bound);
                 }),
                 "reduce_sources_update: source 0 is null"));
  CHECK(a.param == Arrays(4).param);  // nothing was updated
}
