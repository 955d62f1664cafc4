// The name a pool block's memory ledger entry carries (BufferPool and StreamOrderedPool).
#pragma once

#include <string>
#include <string_view>

namespace fullshard {

namespace detail {
/// "<pool>", "<pool>:<label>" or "<pool>:<label>:<owner>" (the empty parts left out).
std::string pool_block_label(const std::string& pool, std::string_view label,
                             std::string_view owner);
}  // namespace detail

}  // namespace fullshard
