// Checked integer arithmetic for sizes that come from user input (shapes, element and byte
// counts, offsets). Every product or sum of such values is computed here: an overflow throws
// (InvalidArgument unless the caller picks another fullshard::Error) with a message that starts
// with the caller's context (a JSON path, a parameter FQN, a tensor name) instead of wrapping
// around into a wrong size.
//
// The context is a string or a callable returning one; a callable is only called on overflow,
// so hot paths pay nothing for building it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "fullshard/base/error.hpp"

namespace fullshard {
/// `context` as a string: itself, or what it returns when it is callable (the context argument
/// of the checked functions).
template <class Context>
std::string context_text(Context&& context) {
  if constexpr (std::is_invocable_v<Context&&>)
    return std::string(std::forward<Context>(context)());
  else
    return std::string(std::forward<Context>(context));
}

/// Throws E "<context>: <a><op><b> does not fit in a signed 64-bit integer" (or "a 64-bit size"
/// for unsigned T): the checked functions' error.
template <class E, class T, class Context>
[[noreturn]] void throw_overflow(T a, const char* op, T b, Context&& context) {
  throw E(context_text(std::forward<Context>(context)) + ": " + std::to_string(a) + op +
          std::to_string(b) + " does not fit in " +
          (std::is_signed_v<T> ? "a signed 64-bit integer" : "a 64-bit size"));
}

/// a * b, or throws E "<context>: <a> * <b> does not fit in a signed 64-bit integer".
template <class E = InvalidArgument, class Context>
std::int64_t checked_mul(std::int64_t a, std::int64_t b, Context&& context) {
  std::int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r))
    throw_overflow<E>(a, " * ", b, std::forward<Context>(context));
  return r;
}

/// a + b, or throws E naming the context.
template <class E = InvalidArgument, class Context>
std::int64_t checked_add(std::int64_t a, std::int64_t b, Context&& context) {
  std::int64_t r = 0;
  if (__builtin_add_overflow(a, b, &r))
    throw_overflow<E>(a, " + ", b, std::forward<Context>(context));
  return r;
}

/// a * b for sizes, or throws E naming the context.
template <class E = InvalidArgument, class Context>
std::size_t checked_mul(std::size_t a, std::size_t b, Context&& context) {
  std::size_t r = 0;
  if (__builtin_mul_overflow(a, b, &r))
    throw_overflow<E>(a, " * ", b, std::forward<Context>(context));
  return r;
}

/// a + b for sizes, or throws E naming the context.
template <class E = InvalidArgument, class Context>
std::size_t checked_add(std::size_t a, std::size_t b, Context&& context) {
  std::size_t r = 0;
  if (__builtin_add_overflow(a, b, &r))
    throw_overflow<E>(a, " + ", b, std::forward<Context>(context));
  return r;
}

}  // namespace fullshard
