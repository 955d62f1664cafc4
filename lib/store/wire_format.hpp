// The messages of a sample store on its private communicator (a duplicate: they never meet the
// caller's).
//
//   kSampleTag  producer -> consumer: a WireHeader, then (a sample) the packed sample
//               (sample_layout.hpp); the end marker is a header alone, sent after the
//               producer's last sample to that consumer on the same tag, so that MPI's
//               non-overtaking rule keeps it behind them
//   kAckTag     consumer -> producer: one int64, the samples from that producer ingested so
//               far (cumulative, so a later acknowledgement supersedes a lost race with an
//               earlier one); kCloseAck at close(): nothing more follows
#pragma once

#include <cstddef>
#include <cstdint>

namespace fullshard::store {

constexpr int kSampleTag = 1;
constexpr int kAckTag = 2;
constexpr std::int64_t kSampleKind = 1;
constexpr std::int64_t kEndKind = 2;
constexpr std::int64_t kCloseAck = -1;

/// What precedes a sample's bytes, and is the whole end marker.
struct WireHeader {
  std::int64_t kind;  // kSampleKind or kEndKind
  std::int64_t step;
  std::int64_t tag;
  std::int64_t seq;  // a sample: its number among those sent to this consumer; end: their count
};
constexpr std::size_t kHeaderBytes = sizeof(WireHeader);
static_assert(kHeaderBytes == 32, "the header keeps the packed sample after it 8-byte aligned");

/// Bytes of one sample's message: its header, then the packed sample.
constexpr std::size_t message_bytes_of(std::size_t sample_bytes) {
  return kHeaderBytes + sample_bytes;
}

}  // namespace fullshard::store
