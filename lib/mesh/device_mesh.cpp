#include "fullshard/mesh/device_mesh.hpp"

#include <Kokkos_Core.hpp>  // KOKKOS_ENABLE_CUDA: whether MemorySpace::device is GPU memory
#include <algorithm>
#include <array>
#include <mutex>
#include <set>

#include "fullshard/base/bounded_comm.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/comm/mpi_communicator.hpp"
#include "fullshard/config.hpp"
#include "fullshard/runtime/runtime.hpp"
#include "lib/base/hash.hpp"
#include "lib/base/mpi_wait.hpp"
#include "lib/comm/shm.hpp"
#if FULLSHARD_HAS_NCCL
#include "lib/comm/nccl_communicator.hpp"
#endif

namespace fullshard {

const char* device_type_name(DeviceType d) noexcept {
  return d == DeviceType::cuda ? "cuda" : "cpu";
}

DeviceType parse_device_type(const std::string& s) {
  if (s == "cpu") return DeviceType::cpu;
  if (s == "cuda") return DeviceType::cuda;
  throw InvalidArgument("DeviceMesh: unknown device type '" + s + "' (use \"cpu\" or \"cuda\")");
}

struct MeshState {
  std::vector<int> shape;
  std::vector<std::string> names;
  std::vector<int> coords;
  int rank = 0;
  int size = 1;
  double timeout_s = 0.0;
  HostProgress host_progress = HostProgress::inline_;
  HostCollectives collectives = HostCollectives::auto_;
  int ranks_per_node = 0;
  std::unique_ptr<comm::MpiCommunicator> world;
  // dims[d][channel]
  std::vector<std::array<std::unique_ptr<comm::MpiCommunicator>, comm::kNumStreams>> dims;
  // shm[d]: the dim's node-local shared memory, or null (MPI).
  std::vector<std::unique_ptr<comm::ShmComm>> shm;
  // split[d]: the dim's ranks grouped by node (a dim spanning nodes), or null.
  std::vector<std::unique_ptr<NodeSplit>> split;
  // Declared after the communicators: destroyed (drained) before them. Created on first use
  // (mutable: a const mesh hands out its streams).
  mutable std::mutex stream_mutex;
  mutable std::array<std::unique_ptr<comm::Stream>, comm::kNumStreams> streams;
  mutable std::unique_ptr<comm::Stream> host_compute;  // CPU meshes: a caller stream

  // The device's resources (CUDA meshes; created with the mesh). The streams are declared
  // before the NCCL communicators, so the communicators go first (finalized while their
  // streams exist).
  DeviceType device = DeviceType::cpu;
  std::array<std::unique_ptr<comm::Stream>, comm::kNumStreams> device_streams;
  std::unique_ptr<comm::Stream> compute;
  // compute_stream_cache(): the compute stream's Kokkos instance (made for the stream
  // compute_cache_of), destroyed before the stream.
  mutable std::mutex compute_mutex;
  mutable void* compute_cache_of = nullptr;
  mutable std::shared_ptr<void> compute_cache;
  // device_bootstrap[d]: an MPI communicator of dim d's ranks used only to broadcast the
  // NCCL unique ids of its device communicators (never in use by another layer when a device
  // communicator is created on first use).
  std::vector<std::unique_ptr<comm::MpiCommunicator>> device_bootstrap;
  // device_dims[d][channel]: NCCL over the ranks of dims[d][channel], created on first use
  // (device_comm; FSDP uses 3 of them in all: the shard dim's all-gather and reduce-scatter
  // channels and the replicate dim's all-reduce channel). Guarded by device_mutex.
  mutable std::mutex device_mutex;
  mutable std::vector<std::array<std::unique_ptr<comm::Communicator>, comm::kNumStreams>>
      device_dims;
};

namespace {

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string s;
  for (const auto& x : v)
    s += (s.empty() ? "" : sep) + x;
  return s;
}

std::string shape_string(const std::vector<int>& shape) {
  std::string s = "(";
  for (std::size_t i = 0; i < shape.size(); ++i)
    s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + ")";
}

// Every rank of `base` must build the same thing (what `description` says) before the
// blocking splits that follow: one nonblocking reduction of its fingerprint under the timeout
// (a rank that never arrives ends in the common timeout message, not a hang inside
// MPI_Comm_split), and a mismatch is an error on every rank.
void agree_on(MPI_Comm base, const std::string& what, const std::string& description,
              double timeout_s) {
  BoundedComm c(base, what, timeout_s, kCollectiveTimeoutHint, what);
  if (first_difference(c, {description}, "MPI_Iallreduce (agreeing on the mesh)") == kNoDifference)
    return;
  throw RankMismatch("rank " + std::to_string(c.rank()) + ": " + what +
                     ": the ranks do not all build the same mesh (this rank: " + description +
                     "); every rank must make the same call with the same shape, dim names, "
                     "device and settings");
}

void validate(const std::vector<int>& shape, const std::vector<std::string>& names, int ranks) {
  if (shape.empty()) throw InvalidArgument("DeviceMesh: the shape is empty; give at least one dim");
  if (names.size() != shape.size())
    throw InvalidArgument("DeviceMesh: shape " + shape_string(shape) + " has " +
                          std::to_string(shape.size()) + " dims but " +
                          std::to_string(names.size()) + " names were given (" + join(names, ", ") +
                          ")");
  std::set<std::string> seen;
  long long product = 1;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (names[i].empty())
      throw InvalidArgument("DeviceMesh: dim " + std::to_string(i) + " has an empty name");
    if (!seen.insert(names[i]).second)
      throw InvalidArgument("DeviceMesh: duplicate dim name '" + names[i] + "'");
    if (shape[i] < 1)
      throw InvalidArgument("DeviceMesh: dim '" + names[i] + "' has size " +
                            std::to_string(shape[i]) + "; sizes must be >= 1");
    product *= shape[i];
  }
  if (product != ranks)
    throw InvalidArgument("DeviceMesh: shape " + shape_string(shape) + " holds " +
                          std::to_string(product) + " ranks but the communicator has " +
                          std::to_string(ranks));
}

// Builds the state over `base`, whose rank order is the mesh's row-major order.
// True when the ranks of `dim_comm` share a node: really (MPI_Comm_split_type), and, with
// the FULLSHARD_RANKS_PER_NODE override, also by the pretended node of their world rank.
// Collective over dim_comm.
bool on_one_node(MPI_Comm dim_comm, int ranks_per_node) {
  bool local = comm::ShmComm::node_local(dim_comm);
  if (ranks_per_node > 0) {
    int world_rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    const int node = world_rank / ranks_per_node;
    int lo = 0;
    int hi = 0;
    MPI_Allreduce(&node, &lo, 1, MPI_INT, MPI_MIN, dim_comm);
    MPI_Allreduce(&node, &hi, 1, MPI_INT, MPI_MAX, dim_comm);
    local = local && lo == hi;
  }
  return local;
}

// An MPI communicator freed with its scope.
struct OwnedComm {
  MPI_Comm c = MPI_COMM_NULL;
  ~OwnedComm() {
    if (c != MPI_COMM_NULL) MPI_Comm_free(&c);
  }
};

// The ranks of `dim_comm` grouped by node, or null (a dim inside one node, uneven nodes, one
// rank per node). Nodes are real (MPI_Comm_split_type) and, with the FULLSHARD_RANKS_PER_NODE
// override, also split by the pretended node of the world rank, as on_one_node does.
// Collective over dim_comm.
std::unique_ptr<NodeSplit> split_by_node(MPI_Comm dim_comm, const std::string& dim_name,
                                         double timeout_s, int ranks_per_node) {
  int rank = 0, size = 0;
  MPI_Comm_rank(dim_comm, &rank);
  MPI_Comm_size(dim_comm, &size);
  OwnedComm real, local;
  MPI_Comm_split_type(dim_comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &real.c);
  int pretend = 0;
  if (ranks_per_node > 0) {
    int world_rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    pretend = world_rank / ranks_per_node;
  }
  MPI_Comm_split(real.c, pretend, rank, &local.c);
  int per_node = 0, local_rank = 0;
  MPI_Comm_size(local.c, &per_node);
  MPI_Comm_rank(local.c, &local_rank);
  int lo = 0, hi = 0;
  MPI_Allreduce(&per_node, &lo, 1, MPI_INT, MPI_MIN, dim_comm);
  MPI_Allreduce(&per_node, &hi, 1, MPI_INT, MPI_MAX, dim_comm);
  if (lo != hi || lo < 2 || lo == size) return nullptr;
  // A node is numbered by its lowest rank in the dim: the same order in every column.
  int node_key = 0;
  MPI_Allreduce(&rank, &node_key, 1, MPI_INT, MPI_MIN, local.c);
  OwnedComm across;
  MPI_Comm_split(dim_comm, local_rank, node_key, &across.c);
  int node = 0;
  MPI_Comm_rank(across.c, &node);
  const int place = node * per_node + local_rank;
  std::vector<int> places(static_cast<std::size_t>(size));
  MPI_Allgather(&place, 1, MPI_INT, places.data(), 1, MPI_INT, dim_comm);
  std::vector<int> dim_ranks(static_cast<std::size_t>(size), -1);
  for (int q = 0; q < size; ++q)
    dim_ranks.at(static_cast<std::size_t>(places[static_cast<std::size_t>(q)])) = q;
  auto shm = std::make_unique<comm::ShmComm>(local.c, dim_name + ".node", timeout_s);
  std::vector<std::unique_ptr<comm::Communicator>> channels;
  for (int c = 0; c < comm::kNumStreams; ++c)
    channels.push_back(comm::MpiCommunicator::duplicate(
        across.c, dim_name + ".across." + comm::stream_name(static_cast<comm::StreamKind>(c)),
        timeout_s));
  return std::make_unique<NodeSplit>(std::move(shm), std::move(channels), node,
                                     std::move(dim_ranks));
}

// What a CUDA mesh needs of the build ("" when it has it).
std::string cuda_mesh_unsupported() {
  std::string missing;
#if !FULLSHARD_HAS_NCCL
  missing = "NCCL (configure with CUDA and NCCL found, FULLSHARD_ENABLE_NCCL=ON)";
#endif
#if !defined(KOKKOS_ENABLE_CUDA)
  missing += std::string(missing.empty() ? "" : " and ") + "a CUDA-enabled Kokkos (this Kokkos " +
             std::to_string(KOKKOS_VERSION) +
             " runs on the host only; build against one: docs/gpu.md, scripts/build-cuda)";
#endif
  return missing;
}

// The device resources of a CUDA mesh: the streams first (they find out whether
// this rank has a usable GPU), agreed on over `base` so that no rank is left in an NCCL
// bootstrap its peers never reach; then one NCCL communicator per dim and channel over the
// channel's MPI communicator (the unique id broadcast under the timeout).
// (build() has checked cuda_mesh_unsupported()).
void build_cuda(MeshState& s, MPI_Comm base, const std::string& mesh_name) {
#if FULLSHARD_HAS_NCCL && defined(KOKKOS_ENABLE_CUDA)
  std::string failure;
  try {
    for (int c = 0; c < comm::kNumStreams; ++c)
      s.device_streams[c] = std::make_unique<comm::Stream>(comm::Stream::device(
          mesh_name + "." + comm::stream_name(static_cast<comm::StreamKind>(c)), /*priority=*/-1));
    s.compute = std::make_unique<comm::Stream>(comm::Stream::device(mesh_name + ".compute", 0));
  } catch (const std::exception& e) {
    failure = e.what();
  }
  int ok = failure.empty() ? 1 : 0;
  int all_ok = 0;
  if (MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, base) != MPI_SUCCESS)
    throw CommError("DeviceMesh(cuda) " + mesh_name +
                    ": MPI_Allreduce agreeing on the device streams failed");
  if (!ok)
    throw CommError("DeviceMesh(cuda) " + mesh_name + " rank " + std::to_string(s.rank) + ": " +
                    failure);
  if (!all_ok)
    throw CommError("DeviceMesh(cuda) " + mesh_name +
                    ": another rank could not create its CUDA "
                    "streams (its own error names the call); no NCCL communicator was created");
  // The NCCL communicators are created on first use (device_comm), over these.
  s.device_dims.resize(s.shape.size());
  s.device_bootstrap.resize(s.shape.size());
  for (std::size_t d = 0; d < s.shape.size(); ++d)
    s.device_bootstrap[d] = comm::MpiCommunicator::duplicate(
        s.dims[d][0]->handle(), s.dims[d][0]->name() + ".nccl-bootstrap", s.timeout_s);
#else
  (void)s;
  (void)base;
  (void)mesh_name;
#endif
}

std::shared_ptr<MeshState> build(MPI_Comm base, std::vector<int> shape,
                                 std::vector<std::string> names, double timeout_s,
                                 HostProgress progress, HostCollectives collectives,
                                 int ranks_per_node, DeviceType device) {
  int ranks = 0;
  int rank = 0;
  MPI_Comm_size(base, &ranks);
  MPI_Comm_rank(base, &rank);
  validate(shape, names, ranks);
  if (progress == HostProgress::thread) {
    int level = MPI_THREAD_SINGLE;
    MPI_Query_thread(&level);
    if (level < MPI_THREAD_MULTIPLE)
      throw ConfigError("DeviceMesh(" + join(names, ",") +
                        "): host progress 'thread' runs MPI on the channel streams' own "
                        "threads and needs MPI_THREAD_MULTIPLE; MPI was initialised with " +
                        thread_level_name(level) + " (use HostProgress::inline_)");
  }
  {
    std::string shape_text;
    for (std::size_t d = 0; d < shape.size(); ++d)
      shape_text += (d ? "x" : "") + std::to_string(shape[d]);
    agree_on(base, "DeviceMesh(" + join(names, ",") + ")",
             "shape " + shape_text + ", dims " + join(names, ",") + ", device " +
                 (device == DeviceType::cuda ? "cuda" : "cpu") + ", host collectives " +
                 host_collectives_name(collectives) + ", ranks per node " +
                 std::to_string(ranks_per_node),
             timeout_s);
  }
  if (device == DeviceType::cuda) {
    const std::string unsupported = cuda_mesh_unsupported();
    if (!unsupported.empty())
      throw ConfigError("DeviceMesh(cuda): this fullshard was built without " + unsupported +
                        "; use a CPU mesh (DeviceType::cpu) here");
  }

  auto s = std::make_shared<MeshState>();
  s->shape = std::move(shape);
  s->names = std::move(names);
  s->rank = rank;
  s->size = ranks;
  s->timeout_s = timeout_s;
  s->host_progress = progress;
  s->collectives = collectives;
  s->ranks_per_node = ranks_per_node;
  s->device = device;
  const int nd = static_cast<int>(s->shape.size());
  s->coords.assign(nd, 0);
  for (int d = nd - 1, r = rank; d >= 0; --d) {
    s->coords[d] = r % s->shape[d];
    r /= s->shape[d];
  }
  const std::string mesh_name = "mesh(" + join(s->names, ",") + ")";
  s->world = comm::MpiCommunicator::duplicate(base, mesh_name, timeout_s);
  s->dims.resize(nd);
  s->shm.resize(nd);
  s->split.resize(nd);
  for (int d = 0; d < nd; ++d) {
    // Ranks that agree on every other coordinate share the dim's communicator; within it
    // they are ordered by their coordinate along d.
    int color = 0;
    for (int e = 0; e < nd; ++e)
      if (e != d) color = color * s->shape[e] + s->coords[e];
    MPI_Comm split = MPI_COMM_NULL;
    if (MPI_Comm_split(base, color, s->coords[d], &split) != MPI_SUCCESS)
      throw CommError("DeviceMesh: MPI_Comm_split for dim '" + s->names[d] + "' failed");
    const std::string dim_name = mesh_name + "." + s->names[d];
    s->dims[d][0] = comm::MpiCommunicator::adopt(split, dim_name, timeout_s);
    for (int c = 1; c < comm::kNumStreams; ++c)
      s->dims[d][c] = comm::MpiCommunicator::duplicate(
          split, dim_name + "." + comm::stream_name(static_cast<comm::StreamKind>(c)), timeout_s);
    // FSDP's host collectives only (a CUDA mesh's go through NCCL).
    if (device == DeviceType::cpu && s->shape[d] > 1 && collectives != HostCollectives::mpi &&
        on_one_node(split, ranks_per_node))
      s->shm[d] = std::make_unique<comm::ShmComm>(split, dim_name, timeout_s);
    else if (device == DeviceType::cpu && d == nd - 1 && s->shape[d] > 2 &&
             collectives != HostCollectives::mpi)  // FSDP's shard dim only (communicators)
      s->split[d] = split_by_node(split, dim_name, timeout_s, ranks_per_node);
  }
  if (device == DeviceType::cuda) build_cuda(*s, base, mesh_name);
  return s;
}

}  // namespace

DeviceMesh::DeviceMesh(const Runtime& runtime, std::vector<int> shape,
                       std::vector<std::string> names)
    : DeviceMesh(runtime.world(), std::move(shape), std::move(names), runtime.settings().timeout_s,
                 runtime.settings().host_progress, runtime.settings().host_collectives,
                 runtime.settings().ranks_per_node) {}

DeviceMesh::DeviceMesh(const Runtime& runtime, DeviceType device, std::vector<int> shape,
                       std::vector<std::string> names)
    : s_(build(runtime.world(), std::move(shape), std::move(names), runtime.settings().timeout_s,
               runtime.settings().host_progress, runtime.settings().host_collectives,
               runtime.settings().ranks_per_node, device)) {}

DeviceMesh::DeviceMesh(DeviceType device, MPI_Comm base, std::vector<int> shape,
                       std::vector<std::string> names, double timeout_s)
    : s_(build(base, std::move(shape), std::move(names), timeout_s, HostProgress::inline_,
               HostCollectives::auto_, 0, device)) {}

DeviceMesh::DeviceMesh(MPI_Comm base, std::vector<int> shape, std::vector<std::string> names,
                       double timeout_s, HostProgress progress, HostCollectives collectives,
                       int ranks_per_node)
    : s_(build(base, std::move(shape), std::move(names), timeout_s, progress, collectives,
               ranks_per_node, DeviceType::cpu)) {}

DeviceMesh init_device_mesh(const Runtime& runtime, const std::string& device_type,
                            std::vector<int> shape, std::vector<std::string> names) {
  return DeviceMesh(runtime, parse_device_type(device_type), std::move(shape), std::move(names));
}

DeviceMesh DeviceMesh::node_aware(const Runtime& runtime) {
  return node_aware(runtime.world(), runtime.settings().ranks_per_node,
                    runtime.settings().timeout_s, runtime.settings().host_progress,
                    runtime.settings().host_collectives);
}

DeviceMesh DeviceMesh::node_aware(MPI_Comm base, int ranks_per_node, double timeout_s,
                                  HostProgress progress, HostCollectives collectives) {
  int rank = 0;
  int ranks = 0;
  MPI_Comm_rank(base, &rank);
  MPI_Comm_size(base, &ranks);
  agree_on(base, "DeviceMesh::node_aware",
           "node-aware mesh, ranks per node " + std::to_string(ranks_per_node) +
               ", host collectives " + host_collectives_name(collectives),
           timeout_s);
  int local_rank = 0;
  int local_size = 0;
  int node = 0;
  if (ranks_per_node > 0) {
    if (ranks % ranks_per_node != 0)
      throw InvalidArgument("DeviceMesh::node_aware: " + std::to_string(ranks_per_node) +
                            " ranks per node do not divide " + std::to_string(ranks) + " ranks");
    local_rank = rank % ranks_per_node;
    local_size = ranks_per_node;
    node = rank / ranks_per_node;
  } else {
    OwnedComm shm;
    MPI_Comm_split_type(base, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &shm.c);
    MPI_Comm_rank(shm.c, &local_rank);
    MPI_Comm_size(shm.c, &local_size);
    // Number the nodes by their lowest rank: leaders (local rank 0) count themselves.
    OwnedComm leaders;
    MPI_Comm_split(base, local_rank == 0 ? 0 : MPI_UNDEFINED, rank, &leaders.c);
    if (local_rank == 0) MPI_Comm_rank(leaders.c, &node);
    MPI_Bcast(&node, 1, MPI_INT, 0, shm.c);
  }
  int min_local = 0;
  int max_local = 0;
  MPI_Allreduce(&local_size, &min_local, 1, MPI_INT, MPI_MIN, base);
  MPI_Allreduce(&local_size, &max_local, 1, MPI_INT, MPI_MAX, base);
  if (min_local != max_local)
    throw InvalidArgument("DeviceMesh::node_aware: nodes run different numbers of ranks (" +
                          std::to_string(min_local) + " to " + std::to_string(max_local) +
                          "); launch the same number of ranks on every node");
  OwnedComm ordered;  // ranks in (node, local) row-major order
  MPI_Comm_split(base, 0, node * local_size + local_rank, &ordered.c);
  return DeviceMesh(build(ordered.c, {ranks / local_size, local_size}, {"node", "local"}, timeout_s,
                          progress, collectives, ranks_per_node, DeviceType::cpu));
}

DeviceType DeviceMesh::device_type() const noexcept {
  return s_->device;
}
int DeviceMesh::ndim() const noexcept {
  return static_cast<int>(s_->shape.size());
}
const std::vector<int>& DeviceMesh::shape() const noexcept {
  return s_->shape;
}
const std::vector<std::string>& DeviceMesh::names() const noexcept {
  return s_->names;
}
int DeviceMesh::size() const noexcept {
  return s_->size;
}
int DeviceMesh::rank() const noexcept {
  return s_->rank;
}
const std::vector<int>& DeviceMesh::coordinates() const noexcept {
  return s_->coords;
}

int DeviceMesh::dim_index(const std::string& dim) const {
  const auto it = std::find(s_->names.begin(), s_->names.end(), dim);
  if (it == s_->names.end())
    throw InvalidArgument("DeviceMesh: unknown dim '" + dim + "' (this mesh has dims " +
                          join(s_->names, ", ") + ")");
  return static_cast<int>(it - s_->names.begin());
}

int DeviceMesh::size(const std::string& dim) const {
  return s_->shape[dim_index(dim)];
}
int DeviceMesh::coordinate(const std::string& dim) const {
  return s_->coords[dim_index(dim)];
}

comm::Communicator& DeviceMesh::comm(const std::string& dim, comm::StreamKind kind) const {
  return *s_->dims[dim_index(dim)][static_cast<int>(kind)];
}

comm::Communicator& DeviceMesh::device_comm(const std::string& dim, comm::StreamKind kind) const {
  const int d = dim_index(dim);
  const int c = static_cast<int>(kind);
  if (s_->device == DeviceType::cpu) return *s_->dims[d][c];
  const MeshState& st = *s_;
  std::lock_guard<std::mutex> lock(st.device_mutex);
  auto& slot = st.device_dims[static_cast<std::size_t>(d)][c];
  if (slot) return *slot;
#if FULLSHARD_HAS_NCCL
  // First use: collective over the dim's ranks (non-blocking NCCL init under the timeout).
  const auto& mpi = *st.dims[d][c];
  if (comm::NcclGroup::depth() > 0)
    throw InvalidArgument("DeviceMesh " + describe() + ": device_comm('" + dim + "', " +
                          comm::stream_name(kind) +
                          ") is used for the first time inside an NCCL "
                          "group; its communicator is created on first use (collective over "
                          "the dim's ranks): use it once outside the group first");
  slot = comm::NcclCommunicator::create(st.device_bootstrap[static_cast<std::size_t>(d)]->handle(),
                                        mpi.name() + ".nccl", st.timeout_s);
  return *slot;
#else
  throw ConfigError("DeviceMesh: a CUDA mesh without NCCL");  // refused when it was built
#endif
}

int DeviceMesh::device_comms_created() const noexcept {
  if (s_->device == DeviceType::cpu) return 0;
  std::lock_guard<std::mutex> lock(s_->device_mutex);
  int n = 0;
  for (const auto& dim : s_->device_dims)
    for (const auto& c : dim)
      n += c != nullptr;
  return n;
}

comm::Stream& DeviceMesh::device_stream(comm::StreamKind kind) const {
  if (s_->device == DeviceType::cpu) return stream(kind);
  return *s_->device_streams[static_cast<int>(kind)];
}

comm::Stream& DeviceMesh::compute_stream() const {
  if (s_->device == DeviceType::cuda) return *s_->compute;
  const MeshState& st = *s_;
  std::lock_guard<std::mutex> lock(st.stream_mutex);
  if (!st.host_compute)
    st.host_compute = std::make_unique<comm::Stream>(comm::Stream::caller("mesh.compute"));
  return *st.host_compute;
}

void* DeviceMesh::compute_stream_cache(std::shared_ptr<void> (*make)(void* native_stream)) const {
  const MeshState& st = *s_;
  void* native = compute_stream().native_handle();
  std::lock_guard<std::mutex> lock(st.compute_mutex);
  if (!st.compute_cache || st.compute_cache_of != native) {
    st.compute_cache = make(native);
    st.compute_cache_of = native;
  }
  return st.compute_cache.get();
}

void DeviceMesh::set_compute_stream(void* cuda_stream) const {
  const MeshState& st = *s_;
  if (st.device != DeviceType::cuda)
    throw InvalidArgument("DeviceMesh " + describe() +
                          ": set_compute_stream needs a CUDA mesh (a CPU mesh computes on the "
                          "calling thread)");
  comm::Stream& current = *st.compute;
  if (current.native_handle() == cuda_stream) return;
  comm::Stream next = comm::Stream::wrap_device(cuda_stream, "mesh.compute(caller's)");
  next.wait(current.record());  // what the old compute stream had enqueued comes first
  current = std::move(next);
}

const comm::ShmComm* DeviceMesh::shm(const std::string& dim) const {
  return s_->shm[static_cast<std::size_t>(dim_index(dim))].get();
}

const NodeSplit* DeviceMesh::node_split(const std::string& dim) const {
  return s_->split[static_cast<std::size_t>(dim_index(dim))].get();
}

NodeSplit::NodeSplit(std::unique_ptr<comm::ShmComm> local,
                     std::vector<std::unique_ptr<comm::Communicator>> across, int node,
                     std::vector<int> dim_ranks)
    : local_(std::move(local)),
      across_(std::move(across)),
      node_(node),
      dim_ranks_(std::move(dim_ranks)) {
  ranks_per_node_ = local_->size();
  nodes_ = static_cast<int>(dim_ranks_.size()) / ranks_per_node_;
}

NodeSplit::~NodeSplit() = default;

comm::Communicator& NodeSplit::across(comm::StreamKind kind) const {
  return *across_.at(static_cast<std::size_t>(kind));
}

comm::Traffic NodeSplit::traffic() const {
  comm::Traffic t = local_->traffic();
  for (const auto& c : across_)
    t += c->traffic();
  return t;
}

HostCollectives DeviceMesh::host_collectives() const noexcept {
  return s_->collectives;
}

comm::Communicator& DeviceMesh::world_comm() const {
  return *s_->world;
}

MPI_Comm DeviceMesh::control_comm(const std::string& dim) const {
  return s_->dims[dim_index(dim)][0]->handle();
}

MPI_Comm DeviceMesh::control_world() const {
  return s_->world->handle();
}

comm::Traffic DeviceMesh::traffic() const {
  comm::Traffic t = s_->world->traffic();
  for (const auto& dim : s_->dims)
    for (const auto& c : dim)
      t += c->traffic();
  for (const auto& shm : s_->shm)
    if (shm) t += shm->traffic();
  for (const auto& split : s_->split)
    if (split) t += split->traffic();
  std::lock_guard<std::mutex> lock(s_->device_mutex);
  for (const auto& dim : s_->device_dims)
    for (const auto& c : dim)
      if (c) t += c->traffic();
  return t;
}

comm::Stream& DeviceMesh::stream(comm::StreamKind kind) const {
  const MeshState& st = *s_;
  std::lock_guard<std::mutex> lock(st.stream_mutex);
  auto& slot = st.streams[static_cast<int>(kind)];
  if (!slot)
    slot = std::make_unique<comm::Stream>(std::string("mesh.") + comm::stream_name(kind),
                                          st.host_progress);
  return *slot;
}

DeviceMesh DeviceMesh::sub_mesh(const std::string& dim) const {
  const int d = dim_index(dim);
  return DeviceMesh(build(s_->dims[d][0]->handle(), {s_->shape[d]}, {dim}, s_->timeout_s,
                          s_->host_progress, s_->collectives, s_->ranks_per_node, s_->device));
}

DeviceMesh DeviceMesh::flatten(const std::vector<std::string>& dims, std::string name) const {
  if (dims.empty()) throw InvalidArgument("DeviceMesh::flatten: no dims given");
  std::set<std::string> seen;
  std::vector<int> idx;
  for (const auto& d : dims) {
    if (!seen.insert(d).second)
      throw InvalidArgument("DeviceMesh::flatten: dim '" + d + "' given twice");
    idx.push_back(dim_index(d));
  }
  // Color: coordinates of the dims not flattened; key: row-major index over the given dims.
  int color = 0;
  int key = 0;
  int size = 1;
  for (int e = 0; e < ndim(); ++e)
    if (!seen.count(s_->names[e])) color = color * s_->shape[e] + s_->coords[e];
  for (int d : idx) {
    key = key * s_->shape[d] + s_->coords[d];
    size *= s_->shape[d];
  }
  agree_on(s_->world->handle(), "DeviceMesh::flatten",
           "flatten of " + join(dims, ",") + " named '" + name + "'", s_->timeout_s);
  OwnedComm split;
  if (MPI_Comm_split(s_->world->handle(), color, key, &split.c) != MPI_SUCCESS)
    throw CommError("DeviceMesh::flatten: MPI_Comm_split failed");
  if (name.empty()) name = join(dims, "_");
  return DeviceMesh(build(split.c, {size}, {name}, s_->timeout_s, s_->host_progress,
                          s_->collectives, s_->ranks_per_node, s_->device));
}

double DeviceMesh::timeout_s() const noexcept {
  return s_->timeout_s;
}
HostProgress DeviceMesh::host_progress() const noexcept {
  return s_->host_progress;
}

std::string DeviceMesh::describe() const {
  std::string s = "(";
  for (int d = 0; d < ndim(); ++d)
    s += (d ? ", " : "") + s_->names[d] + "=" + std::to_string(s_->shape[d]);
  s += ") rank " + std::to_string(s_->rank) + " at (";
  for (int d = 0; d < ndim(); ++d)
    s += (d ? ", " : "") + std::to_string(s_->coords[d]);
  return s + (s_->device == DeviceType::cuda ? ") on cuda" : ")");
}

}  // namespace fullshard
