// Random streams of heat-surrogate: each purpose draws fullshard::apps::uniform01(seed,
// stream, index) from its own stream, so the draws do not depend on the world size.
#pragma once

#include <cstdint>

namespace fullshard::apps::heat {

constexpr std::uint64_t kStreamBlobs = 0x4801;       // initial blobs
constexpr std::uint64_t kStreamSources = 0x4802;     // heat source orbits
constexpr std::uint64_t kStreamEval = 0x4803;        // held-out positions
constexpr std::uint64_t kStreamTrain = 0x4804;       // training positions (+ 0x10000 x attempt)
constexpr std::uint64_t kStreamBatch = 0x100000000;  // minibatch draws (+ training rank)

}  // namespace fullshard::apps::heat
