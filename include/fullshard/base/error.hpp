// Exceptions thrown by fullshard. Every message starts with "fullshard[rank R]" and names
// what was wrong (variable, mesh dim, communicator, operation, module, parameter).
#pragma once

#include <cstddef>
#include <exception>
#include <stdexcept>
#include <string>

namespace fullshard {

/// Base class of every exception fullshard throws.
class Error : public std::runtime_error {
 public:
  /// `what` is prefixed with "fullshard[rank R]: " (R = MPI_COMM_WORLD rank, or "-" before
  /// MPI is initialised) so that a message from any rank of a job says where it came from.
  explicit Error(const std::string& what);
  int rank() const noexcept { return rank_; }
  /// `what` as given, without the prefix (for a message that wraps this one).
  const char* message() const noexcept { return this->what() + prefix_; }

 private:
  int rank_;
  std::size_t prefix_;
};

/// A bad setting: environment variable, option or argument value.
class ConfigError : public Error {
 public:
  using Error::Error;
};

/// A bad FULLSHARD_* environment variable (Settings): what an application reports like a bad
/// command-line option (the apps exit with status 2).
class SettingsError : public ConfigError {
 public:
  using ConfigError::ConfigError;
};

/// The ranks of one communicator declared different things (mesh, FSDP groups and policies,
/// model configuration): thrown on every rank, naming the first difference.
class RankMismatch : public ConfigError {
 public:
  using ConfigError::ConfigError;
};

/// A bad argument to an API call (sizes, shapes, names).
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

/// A file that could not be read or written, or is not what it must be (a missing or corrupt
/// checkpoint, a truncated TorchScript archive): the message names the file. The C API's
/// FULLSHARD_ERR_IO.
class IoError : public Error {
 public:
  using Error::Error;
};

/// A failed communication call (MPI or NCCL); the message names communicator and operation.
class CommError : public Error {
 public:
  using Error::Error;
};

}  // namespace fullshard
