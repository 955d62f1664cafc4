// The cross-rank fingerprint of an FSDP configuration: before the first collective of an FSDP
// root, the ranks compare what they declared (mesh, groups, parameter shapes and dtypes,
// policies), so that a mismatch is reported on every rank, naming the first difference,
// instead of a hang, a truncated message or a crash inside MPI. Private to lib/fsdp.
#pragma once

#include <string>
#include <vector>

#include "fullshard/mesh/device_mesh.hpp"

namespace fullshard::fsdp::detail {

/// Compares `items` (one line per entry, the same order on every rank) across the ranks of
/// `mesh`: two all-reduces of 64-bit hashes (and one broadcast of rank 0's entry on a
/// difference), bounded by the mesh's timeout. Throws ConfigError on every rank naming the
/// first differing entry, rank 0's version and this rank's. Collective over the mesh.
void agree_across_ranks(const DeviceMesh& mesh, const std::vector<std::string>& items,
                        const std::string& what);

}  // namespace fullshard::fsdp::detail
