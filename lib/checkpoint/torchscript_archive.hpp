// A TorchScript file (torch.jit.save's zip archive) checked before LibTorch reads it.
//
// LibTorch trusts the archive: a tensor record shorter than the storage its pickle declares
// is read past its end (a crash, or garbage weights), and a tensor view larger than its
// storage likewise. check_torchscript_archive reads only the zip's directory and the pickles
// (data.pkl, constants.pkl), never the tensor records, and refuses, naming the file and the
// record:
//   - a zip that is not one (no end of central directory, entries outside the file,
//     compressed or encrypted entries: torch.jit.save stores them), more than
//     limits.max_records entries, duplicate names;
//   - a pickle with an opcode outside what torch.jit.save writes, or malformed (stack, memo,
//     lengths past the end), larger than limits.max_pickle_bytes;
//   - a storage whose record is missing or shorter than its element count times its element
//     size, an unknown storage type, a tensor whose offset, sizes and strides reach past its
//     storage.
// Every error is a fullshard::Error naming the file and what was wrong. Not collective.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fullshard::checkpoint {

struct TorchScriptLimits {
  std::int64_t max_records = 1 << 20;
  std::int64_t max_pickle_bytes = std::int64_t{256} << 20;
};

/// What a checked archive holds.
struct TorchScriptArchive {
  std::string prefix;              // the archive's top folder ("archive", "model", ...)
  std::int64_t records = 0;        // zip entries
  std::int64_t storages = 0;       // tensor storages its pickles declare
  std::int64_t storage_bytes = 0;  // their declared bytes (the weights LibTorch will read)
};

/// Checks the TorchScript file at `path` (a regular file; read with bounds, never mapped).
TorchScriptArchive check_torchscript_archive(const std::string& path,
                                             const TorchScriptLimits& limits = {});

/// The same for an archive in memory (`name` names it in messages).
TorchScriptArchive check_torchscript_archive(const void* data, std::size_t size,
                                             const std::string& name,
                                             const TorchScriptLimits& limits = {});

}  // namespace fullshard::checkpoint
