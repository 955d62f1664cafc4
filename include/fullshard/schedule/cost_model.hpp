// The cost model of a plan: alpha-beta times for each collective on each mesh dim, a copy
// bandwidth for the shard copy kernels, and the graph's declared compute times.
// JSON schema: docs/plan-format.md.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "fullshard/transport/fusions.hpp"

namespace fullshard {
class DeviceMesh;
class NodeSplit;
}  // namespace fullshard
namespace fullshard::comm {
class Communicator;
class ShmComm;
}  // namespace fullshard::comm

namespace fullshard::schedule {

/// The collectives a plan uses (a group's transport's).
using CollectiveKind = transport::CollectiveKind;
/// The mesh dims: shard (FSDP's dim) and replicate (HSDP's outer dim).
enum class MeshDim { shard, replicate };

/// How a mesh dim's host collectives run (FULLSHARD_HOST_COLLECTIVES, DeviceMesh::shm): MPI
/// collectives with separate copy kernels, or node-local shared memory; what each folds into
/// its collectives is transport::fusions, the rule the running transports follow.
using Transport = transport::Kind;  // mpi, shm (nccl: costed as mpi)

const char* collective_kind_name(CollectiveKind k) noexcept;
const char* mesh_dim_name(MeshDim d) noexcept;
inline const char* transport_name(Transport t) noexcept {
  return transport::kind_name(t);
}

/// A data-parallel mesh as the planner sees it: `shard_size` ranks share the parameters,
/// `replicate_size` copies of that group (1: FSDP; > 1: HSDP). Made by name only, in the
/// DeviceMesh's order (replicate, shard): `MeshShape::fsdp(4)`, `MeshShape::hsdp(2, 4)`; a
/// brace list `MeshShape{a, b}` does not compile, so no order can be misread.
struct MeshShape {
  int shard_size = 1;      ///< the shard dim: the mesh's last
  int replicate_size = 1;  ///< the replicate dim (HSDP): the mesh's first

  MeshShape() noexcept : MeshShape(1, 1) {}
  /// FSDP: one shard group of `shard` ranks.
  static MeshShape fsdp(int shard) noexcept { return MeshShape(1, shard); }
  /// HSDP: `replicate` copies of a `shard`-rank group (a replicate x shard DeviceMesh).
  static MeshShape hsdp(int replicate, int shard) noexcept { return MeshShape(replicate, shard); }
  int world() const noexcept { return shard_size * replicate_size; }
  /// The shape of a DeviceMesh: its last dim shards, a 2-D mesh's first replicates.
  static MeshShape of(const DeviceMesh& mesh);

 private:
  MeshShape(int replicate, int shard) noexcept : shard_size(shard), replicate_size(replicate) {}
};

/// The time of one collective as a function of its bytes: the line alpha_ms + bytes *
/// beta_ms_per_byte, or, with two or more measured points attached (CostModel::calibrate keeps
/// what it measured; a cost file's "points"), the points joined by straight segments: a real
/// link is not a line (TCP over a shaped link: a 4-rank reduce-scatter 17.5 ms at 512 KiB,
/// 82 ms at 1 MiB), so a time between two measured sizes is interpolated between them, and
/// above the largest measured size it is the last point plus the line's slope, below the
/// smallest the segment from (0, alpha_ms) to the first point (alpha capped at its time).
struct AlphaBeta {
  /// One measurement: `bytes` (per rank, as CostModel::time_ms takes them) took `ms`.
  struct Point {
    double bytes = 0.0;
    double ms = 0.0;
    bool operator==(const Point& o) const noexcept { return bytes == o.bytes && ms == o.ms; }
  };

  double alpha_ms = 0.0;
  double beta_ms_per_byte = 0.0;
  /// Increasing bytes (set_points checks); empty or one point: the line alone.
  std::vector<Point> points;

  AlphaBeta() = default;
  AlphaBeta(double alpha, double beta) noexcept : alpha_ms(alpha), beta_ms_per_byte(beta) {}

  double time_ms(double bytes) const noexcept {
    return points.size() < 2 ? alpha_ms + bytes * beta_ms_per_byte : interpolated_ms(bytes);
  }
  /// Replaces the points; InvalidArgument unless the bytes strictly increase and every value
  /// is finite and >= 0.
  void set_points(std::vector<Point> p);
  bool operator==(const AlphaBeta& o) const noexcept {
    return alpha_ms == o.alpha_ms && beta_ms_per_byte == o.beta_ms_per_byte && points == o.points;
  }
  bool operator!=(const AlphaBeta& o) const noexcept { return !(*this == o); }

 private:
  double interpolated_ms(double bytes) const noexcept;
};

class CostModel {
 public:
  /// Defaults for the development host (documented in docs/plan-format.md): alpha 20 us for
  /// every collective, 1 GB/s bus bandwidth, 10 GB/s copy bandwidth, beta derived from the
  /// bus bandwidth for the mesh: all-gather and reduce-scatter over n ranks move
  /// bytes_per_rank * (n - 1) bytes over the bus (beta = (n-1) / bus_bw), an all-reduce
  /// 2 * bytes * (n-1) / n (beta = 2 (n-1) / n / bus_bw); a dim of one rank costs alpha only.
  /// Shared memory (shm_collective; transport() stays mpi on every dim): alpha 5 us, beta
  /// from the copy bandwidth and the bytes a rank's kernel passes over: an all-gather copies
  /// n slots of bytes_per_rank into the unsharded parameters, a reduce-scatter reads n chunks
  /// of the shard it produces (beta = n / copy_bw for a dim of n ranks).
  static CostModel defaults(const MeshShape& mesh, double alpha_ms = 0.02,
                            double bus_gb_per_s = 1.0, double copy_gb_per_s = 10.0);
  /// defaults(MeshShape::hsdp(2, 2)).
  CostModel();

  const AlphaBeta& collective(CollectiveKind k, MeshDim d) const noexcept;
  AlphaBeta& collective(CollectiveKind k, MeshDim d) noexcept;
  /// The pair's time_ms(bytes_per_rank) (the line, or its measured points). bytes_per_rank: the
  /// shard a rank contributes to an all-gather, the shard it receives from a reduce-scatter, the
  /// buffer of an all-reduce.
  double time_ms(CollectiveKind k, MeshDim d, double bytes_per_rank) const noexcept;

  /// The transport of dim `d`'s collectives (default mpi). The planner costs all-gathers and
  /// reduce-scatters on the shard dim with shm_collective() when it is shm; the all-reduce
  /// (replicate dim) has no shared-memory form and always costs collective().
  Transport transport(MeshDim d) const noexcept { return transport_[static_cast<int>(d)]; }
  void set_transport(MeshDim d, Transport t) noexcept { transport_[static_cast<int>(d)] = t; }
  /// The shared-memory alpha-beta of an all-gather (its copy-out included: the time to have
  /// every slot in the unsharded parameters) or a reduce-scatter (copy-in and, without HSDP,
  /// copy-out included), bytes per rank as time_ms takes them. InvalidArgument for
  /// all_reduce.
  const AlphaBeta& shm_collective(CollectiveKind k, MeshDim d) const;
  AlphaBeta& shm_collective(CollectiveKind k, MeshDim d);
  double shm_time_ms(CollectiveKind k, MeshDim d, double bytes_per_rank) const {
    return shm_collective(k, d).time_ms(bytes_per_rank);
  }

  /// Copy kernels (copy-in, copy-out, casts, gradient zeroing): bytes written / bandwidth.
  double copy_gb_per_s() const noexcept { return copy_gb_per_s_; }
  void set_copy_gb_per_s(double v);
  double copy_ms(double bytes) const noexcept { return bytes / (copy_gb_per_s_ * 1e6); }

  /// Compressed collectives' kernels (encode into 8-bit codes with block scales; decode in the
  /// copy-out or the reduce-scatter's sum): time per element of one pass, ns (default 0.6,
  /// this development host's).
  double quant_ns_per_element() const noexcept { return quant_ns_per_element_; }
  void set_quant_ns_per_element(double v);
  double quant_ms(double elements) const noexcept {
    return elements * quant_ns_per_element_ * 1e-6;
  }

  /// The JSON form (every key written), as text (`indent` < 0: on one line).
  std::string to_json(int indent = -1) const;
  /// Reads the JSON `text` over `base`: keys present replace base's values. ConfigError
  /// "<source>: invalid JSON ..." when it does not parse, "<source>: <JSON path>: <problem>"
  /// on unknown keys, wrong types, negative or non-finite numbers, a non-positive copy
  /// bandwidth.
  static CostModel parse_json(const std::string& text, const CostModel& base,
                              const std::string& source = "<cost>");
  /// parse_json on a file's contents; ConfigError naming the path when it cannot be read.
  static CostModel load_json(const std::string& path, const CostModel& base);

  /// Measures all_gather and reduce_scatter on (a dup of) `shard_comm`, and all_reduce on
  /// `replicate_comm` when given, at each of `sizes` (bytes per rank, f32), `reps` times
  /// (the fastest counts), agrees on the slowest rank's times (all ranks get the same model),
  /// fits alpha, beta by least squares (clamped at 0) and keeps the measured times as the
  /// pair's points (two or more sizes: time_ms interpolates them). The copy bandwidth is measured
  /// with a memcpy of the largest size, the quantize cost with an int8 encode of it. With
  /// `shard_shm` (the shard dim's DeviceMesh::shm, over the same ranks) it also measures the
  /// shared-memory all-gather and reduce-scatter the running backend does (counter publish and wait
  /// on a ShmWindow, the Kokkos copy of every peer's slot; the fused sum over every peer's chunk
  /// with the divide) and sets transport(shard) to shm; without it transport(shard) is mpi. With
  /// `shard_split` instead (the shard dim's DeviceMesh::node_split: it spans nodes) it measures
  /// the two-level path: the shard dim's all-gather and reduce-scatter on the communicator
  /// across nodes (the MPI part), the shared-memory pair on the node's ranks reading all W
  /// slots (the copy-out) and summing a chunk per node (the node's sum), and sets
  /// transport(shard) to shm+mpi. With
  /// `median` the median of the reps counts instead of the fastest (what a training step sees on a
  /// shared host: fullshard-calibrate --median). Collective over the communicators: every rank
  /// calls it with the same arguments. Values not measured come from `base`.
  static CostModel calibrate(const comm::Communicator& shard_comm, const CostModel& base,
                             const comm::Communicator* replicate_comm = nullptr,
                             const std::vector<std::size_t>& sizes = {1 << 16, 1 << 20, 1 << 22},
                             int reps = 3, const comm::ShmComm* shard_shm = nullptr,
                             bool median = false, const NodeSplit* shard_split = nullptr);

  /// The same model with every time multiplied by `factor` (> 0, finite; InvalidArgument
  /// otherwise): alphas, betas and measured points of every collective, the copy and quantize
  /// kernels. What a measured-to-predicted ratio of a run's collectives calibrates.
  CostModel scaled(double factor) const;

  bool operator==(const CostModel& o) const noexcept;
  bool operator!=(const CostModel& o) const noexcept { return !(*this == o); }

 private:
  AlphaBeta c_[3][2];
  AlphaBeta shm_[2][2];  // [all_gather | reduce_scatter][dim]
  Transport transport_[2] = {Transport::mpi, Transport::mpi};
  double copy_gb_per_s_ = 10.0;
  double quant_ns_per_element_ = 0.6;
};

/// CostModel::defaults for `mesh` (its shard and replicate sizes: the last dim shards, a 2-D
/// mesh's first replicates) with the shard dim's transport as the mesh runs it: shared memory
/// where its ranks share a node (DeviceMesh::shm), shared memory inside the nodes and MPI
/// across where it spans nodes (DeviceMesh::node_split), MPI otherwise.
CostModel mesh_defaults(const DeviceMesh& mesh);

/// A two-level network (cluster scale by simulation): `gpus_per_node` ranks per node joined
/// by NVLink, nodes joined by InfiniBand with one NIC per GPU. Ranks are numbered node by
/// node and a mesh lays out its shard dim fastest (rank = replica * shard + shard_rank), so a
/// shard group of S ranks spans min(S, G) GPUs of each of ceil(S / G) nodes and a replicate
/// group takes one rank of each shard group. Collectives are hierarchical rings: an
/// all-gather (reduce-scatter) over g GPUs per node times m nodes runs a ring over the m nodes
/// on InfiniBand (per-rank shard b: m - 1 steps of b bytes) and a ring inside the node on
/// NVLink (g - 1 steps of m * b bytes); an all-reduce of B bytes is a reduce-scatter plus an
/// all-gather of B / (g m) per rank, with a tree's 2 log2(m) latency across nodes. Each
/// step costs the link's alpha + bytes * beta. Every such time is linear in the bytes, so the
/// network compiles into the CostModel's alpha-beta pairs (cost_model()). Constants and
/// their sources: docs/plan-format.md, "Two-level network".
struct TwoLevelNetwork {
  int gpus_per_node = 8;
  /// Per ring step inside a node (NVLink) and across nodes (InfiniBand).
  AlphaBeta nvlink;
  AlphaBeta infiniband;

  /// 8 x H100 SXM per node (NVLink 4, 450 GB/s per direction per GPU), one 400 Gb/s NDR
  /// InfiniBand NIC per GPU; latencies from NCCL's tuning model.
  static TwoLevelNetwork dgx_h100();

  /// (GPUs per node g, nodes m) of the ranks of one group of mesh dim `d`.
  std::pair<int, int> span(const MeshShape& mesh, MeshDim d) const;
  /// The alpha-beta pair of collective `k` on dim `d` (bytes as CostModel::time_ms takes).
  AlphaBeta collective(const MeshShape& mesh, CollectiveKind k, MeshDim d) const;
  /// Bytes one rank receives over each link level for one such collective.
  struct LinkBytes {
    double nvlink = 0.0;
    double infiniband = 0.0;
  };
  LinkBytes link_bytes(const MeshShape& mesh, CollectiveKind k, MeshDim d,
                       double bytes_per_rank) const;
  /// CostModel::defaults(mesh) with every collective from this network and the given copy
  /// bandwidth (the GPU's memory bandwidth for the copy kernels).
  CostModel cost_model(const MeshShape& mesh, double copy_gb_per_s) const;

  /// {"gpus_per_node": 8, "nvlink": {"alpha_ms": ..., "gb_per_s": ...},
  ///  "infiniband": {...}} as text (`indent` < 0: on one line); parse_json reads such a text
  /// over `base` (keys present replace base's), ConfigError "<source>: <JSON path>:
  /// <problem>" like CostModel::parse_json.
  std::string to_json(int indent = -1) const;
  static TwoLevelNetwork parse_json(const std::string& text, const TwoLevelNetwork& base,
                                    const std::string& source = "<network>");
  /// Loads a JSON file; ConfigError naming the path when it cannot be read or parsed.
  static TwoLevelNetwork load_json(const std::string& path, const TwoLevelNetwork& base);
};

/// Least-squares fit of t = alpha + beta * x (alpha, beta clamped at >= 0).
AlphaBeta fit_alpha_beta(const std::vector<double>& x, const std::vector<double>& t);

}  // namespace fullshard::schedule
