// Reading a whole text file (a configuration, a graph, a data file) safely on every rank of a
// job: a FIFO, a device or a directory is refused before anything is read (a FIFO would block
// every rank forever), and so is a file larger than a bound.
#pragma once

#include <cstdint>
#include <string>

namespace fullshard {

/// The largest text file read_text_file reads unless told otherwise (1 GiB).
inline constexpr std::uint64_t kMaxTextFileBytes = std::uint64_t{1} << 30;

/// The whole of file `path`, which must be a regular file of at most `max_bytes`.
/// ConfigError "<path>: cannot read the <what> (<reason>)" otherwise (`what`: "configuration",
/// "--data file", ...).
std::string read_text_file(const std::string& path, const std::string& what,
                           std::uint64_t max_bytes = kMaxTextFileBytes);

}  // namespace fullshard
