// The message of an exception without fullshard's rank prefix, for a message that wraps it.
#pragma once

#include <exception>
#include <string>

#include "fullshard/base/error.hpp"

namespace fullshard {

namespace detail {
/// e.what(), without the "fullshard[rank R]: " prefix when `e` is an Error.
inline std::string message_of(const std::exception& e) {
  const auto* f = dynamic_cast<const Error*>(&e);
  return f ? f->message() : e.what();
}
}  // namespace detail

}  // namespace fullshard
