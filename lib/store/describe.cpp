#include "lib/store/describe.hpp"

#include <cstdio>

namespace fullshard::store {

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i)
    s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string index_text(const std::vector<std::int64_t>& shape, std::int64_t e) {
  std::vector<std::int64_t> idx(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) {
    idx[d] = e % shape[d];
    e /= shape[d];
  }
  return shape_text(idx);
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string s;
  for (std::size_t i = 0; i < ranks.size(); ++i)
    s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

std::string value_text(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", v);
  return b;
}

const char* policy_name(Policy p) {
  switch (p) {
    case Policy::fifo:
      return "fifo";
    case Policy::reservoir:
      return "reservoir";
    case Policy::window:
      return "window";
  }
  return "?";
}

const char* delivery_name(Delivery d) {
  return d == Delivery::lossless ? "lossless" : "nonblocking";
}

const char* role_name(Role r) {
  switch (r) {
    case Role::producer:
      return "producer";
    case Role::consumer:
      return "consumer";
    case Role::both:
      return "both";
  }
  return "?";
}

}  // namespace fullshard::store
