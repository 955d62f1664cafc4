// Cross-rank agreement: before the first collective of something every rank must declare
// alike (an FSDP root's groups and policies, a model configuration of the C API), the ranks
// compare what they declared, so that a mismatch is reported on every rank naming the first
// difference, instead of a hang, a truncated message or a crash inside MPI.
#pragma once

#include <string>
#include <vector>

#include "fullshard/mesh/device_mesh.hpp"

namespace fullshard {

/// Compares `items` (one line per entry, the same order on every rank) across the ranks of
/// `mesh`: two all-reduces of 64-bit hashes (and one broadcast of rank 0's entry on a
/// difference), bounded by the mesh's timeout. Throws RankMismatch on every rank naming
/// `what`, the first differing entry, rank 0's version and this rank's. Collective over the
/// mesh.
void agree_across_ranks(const DeviceMesh& mesh, const std::vector<std::string>& items,
                        const std::string& what);

}  // namespace fullshard
