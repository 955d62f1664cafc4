// Error-checking helpers for doctest suites.
#pragma once

#include <doctest/doctest.h>

#include <exception>
#include <functional>
#include <string>

namespace fullshard::test {

/// The message of the E thrown by fn ("" and a failed check when none or another type is thrown).
template <class E>
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL_CHECK("unexpected exception type: " << e.what());
    return "";
  }
  FAIL_CHECK("no exception thrown");
  return "";
}

inline bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace fullshard::test
