#include "fullshard/base/dtype.hpp"

#include <algorithm>
#include <cctype>

#include "fullshard/base/error.hpp"

namespace fullshard {

const char* dtype_name(DType t) noexcept {
  switch (t) {
    case DType::f32:
      return "f32";
    case DType::f64:
      return "f64";
    case DType::f16:
      return "f16";
    case DType::bf16:
      return "bf16";
  }
  return "?";
}

DType parse_dtype(const std::string& name, const std::string& what) {
  std::string s = name;
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  if (s == "f32" || s == "float32" || s == "float") return DType::f32;
  if (s == "f64" || s == "float64" || s == "double") return DType::f64;
  if (s == "f16" || s == "float16" || s == "half") return DType::f16;
  if (s == "bf16" || s == "bfloat16") return DType::bf16;
  throw ConfigError(what + ": unknown dtype '" + name + "' (expected f32, f64, f16 or bf16)");
}

double load_as_double(const void* data, DType t, std::size_t i) noexcept {
  switch (t) {
    case DType::f32:
      return static_cast<const float*>(data)[i];
    case DType::f64:
      return static_cast<const double*>(data)[i];
    case DType::f16:
      return f16_to_float(static_cast<const std::uint16_t*>(data)[i]);
    case DType::bf16:
      return bf16_to_float(static_cast<const std::uint16_t*>(data)[i]);
  }
  return 0.0;
}

void store_from_double(void* data, DType t, std::size_t i, double v) noexcept {
  switch (t) {
    case DType::f32:
      static_cast<float*>(data)[i] = static_cast<float>(v);
      break;
    case DType::f64:
      static_cast<double*>(data)[i] = v;
      break;
    case DType::f16:
      static_cast<std::uint16_t*>(data)[i] = float_to_f16(static_cast<float>(v));
      break;
    case DType::bf16:
      static_cast<std::uint16_t*>(data)[i] = float_to_bf16(static_cast<float>(v));
      break;
  }
}

}  // namespace fullshard
