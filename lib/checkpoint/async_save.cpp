// save_async(): the synchronous save's steps (lib/checkpoint/save_parts.hpp) split at the
// data files. On the training thread: prepare, start (the temporary step directory) and the
// snapshot (every shard this rank writes copied into one host staging buffer, host shards
// checksummed as they are copied: copy_crc32c); then a background thread writes the rank's
// data file from staging (and fsyncs it; checksums only shards copied from a device: no MPI,
// no model memory); test() / wait() on the training thread again: the agreement on the
// writers' outcome, rank 0's commit and retention. The staging buffer is kept for the next
// save (its pages stay faulted in), and only one save is in flight: the next one completes it
// first.
#include "fullshard/checkpoint/async_save.hpp"

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "fullshard/base/error.hpp"
#include "fullshard/checkpoint/checksum.hpp"
#include "lib/checkpoint/crc32c_variants.hpp"
#include "lib/checkpoint/save_parts.hpp"
#include "lib/tensor/staging.hpp"

namespace fullshard::checkpoint {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

struct AsyncSave::State {
  std::unique_ptr<detail::Comm> comm;  // the save's own communicator, freed once complete
  std::string dir;
  SaveOptions options;
  Index index;
  detail::PendingStep pending;
  detail::Fault fault;
  // This rank's shards, each SaveEntry::local a view of the staging buffer, which holds them
  // back to back as the data file will (writers only).
  std::vector<detail::SaveEntry> staged;
  // Per staged entry, its blocks' CRC32C when the snapshot computed them as it copied (host
  // sources); empty: the writer computes them (shards copied from a device).
  std::vector<std::vector<std::uint32_t>> block_crcs;
  const char* image = nullptr;
  std::string file;  // the data file, empty on ranks that write none
  std::uint64_t staging_bytes = 0;
  double snapshot_s = 0;

  // The background writer. `written` is set (release) after record / write_error / write_s.
  std::thread writer;
  std::atomic<bool> written{false};
  std::string record;
  std::exception_ptr write_error;
  double write_s = 0;

  // The outcome, once complete (on every rank at the same call).
  bool complete = false;
  std::string step_dir;
  std::exception_ptr error;

  ~State() {
    if (writer.joinable()) writer.join();  // a save in flight at exit: nothing committed
  }

  void write() noexcept {
    const auto t0 = Clock::now();
    try {
      if (fault.armed("slow_write")) std::this_thread::sleep_for(std::chrono::seconds(3));
      record = detail::write_image(staged, block_crcs, image, staging_bytes, file,
                                   index.block_bytes, pending.tmp, fault);
    } catch (...) {
      write_error = std::current_exception();
    }
    write_s = seconds_since(t0);
    written.store(true, std::memory_order_release);
  }
};

namespace {

// The process's one save in flight, and the staging buffer its snapshot reuses.
struct InFlight {
  std::mutex mutex;
  std::shared_ptr<AsyncSave::State> save;
  Tensor staging;       // grown as needed, never shrunk
  bool hooked = false;  // release_at_finalize registered with this Kokkos session
};

InFlight& in_flight() {
  static InFlight f;
  return f;
}

// Kokkos finalize hook (the staging buffer is Kokkos memory): a save still in flight ends
// uncommitted (its writer is joined), and the staging buffer is freed.
void release_at_finalize() {
  InFlight& f = in_flight();
  std::lock_guard<std::mutex> lock(f.mutex);
  if (f.save) {
    if (f.save->writer.joinable()) f.save->writer.join();
    f.save->staged.clear();
  }
  f.staging = Tensor();
  f.hooked = false;
}

// The staging buffer, at least `bytes` long from its first kDirectAlign-aligned byte (every
// earlier save is complete), and whether it is new (its pages not faulted in yet).
std::pair<Tensor, bool> staging_buffer(std::uint64_t bytes, const char* caller) {
  bytes += detail::kDirectAlign;
  InFlight& f = in_flight();
  std::lock_guard<std::mutex> lock(f.mutex);
  if (f.staging.nbytes() >= bytes) return {f.staging, false};
  if (f.save)
    throw InvalidArgument(std::string(caller) +
                          ": an asynchronous save is in flight and writes from the staging "
                          "buffer (wait() for it first)");
  if (!f.hooked) {
    Kokkos::push_finalize_hook(release_at_finalize);
    f.hooked = true;
  }
  f.staging = Tensor();  // the old buffer goes first
  f.staging = ::fullshard::detail::pinned_host_tensor({static_cast<std::int64_t>((bytes + 7) / 8)},
                                                      DType::f64, "fullshard::async_save_staging");
  detail::advise_huge_pages(f.staging);
  return {f.staging, true};
}

// Agrees on the writers' outcome and commits (on every rank at the same call); stores the
// outcome, frees the communicator and ends the save's time in flight.
void complete(AsyncSave::State& st) {
  if (st.writer.joinable()) st.writer.join();
  try {
    detail::agree_or_abandon(*st.comm, st.write_error, st.pending);
    st.step_dir = detail::commit_sharded(*st.comm, st.record, st.index, st.pending, st.fault);
    detail::apply_retention(*st.comm, st.dir, st.options);
  } catch (...) {
    st.error = std::current_exception();
  }
  st.complete = true;
  st.staged.clear();  // the views of the staging buffer
  st.comm.reset();
  {
    InFlight& f = in_flight();
    std::lock_guard<std::mutex> lock(f.mutex);
    if (f.save.get() == &st) f.save.reset();
  }
  if (st.error) std::rethrow_exception(st.error);
}

AsyncSave::State& state_of(const std::shared_ptr<AsyncSave::State>& s, const char* call) {
  if (!s)
    throw InvalidArgument(std::string("checkpoint::AsyncSave::") + call +
                          ": this handle names no save (default-constructed)");
  return *s;
}

}  // namespace

namespace detail {

void complete_async_save() {
  std::shared_ptr<AsyncSave::State> s;
  {
    InFlight& f = in_flight();
    std::lock_guard<std::mutex> lock(f.mutex);
    s = f.save;
  }
  if (s && !s->complete) complete(*s);
}

}  // namespace detail

bool AsyncSave::test() {
  State& st = state_of(state_, "test");
  if (!st.complete) {
    const int mine = st.written.load(std::memory_order_acquire) ? 1 : 0;
    if (st.comm->allreduce(mine, MPI_MIN, "MPI_Iallreduce (asynchronous save: written?)") == 0)
      return false;
    complete(st);
  }
  if (st.error) std::rethrow_exception(st.error);
  return true;
}

std::string AsyncSave::wait() {
  State& st = state_of(state_, "wait");
  if (!st.complete) complete(st);
  if (st.error) std::rethrow_exception(st.error);
  return st.step_dir;
}

bool AsyncSave::done() const noexcept {
  return state_ && state_->complete;
}

std::int64_t AsyncSave::step() const {
  return state_of(state_, "step").index.step;
}

std::uint64_t AsyncSave::staging_bytes() const {
  return state_of(state_, "staging_bytes").staging_bytes;
}

double AsyncSave::snapshot_seconds() const {
  return state_of(state_, "snapshot_seconds").snapshot_s;
}

double AsyncSave::write_seconds() const {
  const State& st = state_of(state_, "write_seconds");
  return st.written.load(std::memory_order_acquire) ? st.write_s : 0.0;
}

AsyncSave save_async(const std::string& dir, graph::Module& model,
                     const optim::Optimizer* optimizer, std::int64_t step,
                     const std::string& metadata, const std::string& rng_state,
                     const SaveOptions& options) {
  const auto t0 = Clock::now();
  const DeviceMesh& mesh = detail::model_mesh(model, "checkpoint::save_async");
  auto st = std::make_shared<AsyncSave::State>();
  st->comm = detail::checkpoint_comm(mesh.control_world(), mesh.timeout_s(),
                                     "asynchronous checkpoint save of '" + dir + "'");
  detail::Comm& c = *st->comm;
  detail::complete_async_save();  // at most one save in flight; its error is raised here
  SaveOptions checked = options;
  if (options.kind != Kind::sharded) {
    checked.kind = Kind::sharded;
    // Agreed like prepare_save's checks (every rank has the same options).
    detail::agree(c,
                  std::make_exception_ptr(InvalidArgument(
                      "checkpoint::save_async: writes sharded checkpoints only (a full "
                      "checkpoint is gathered to rank 0 as it is written: use save())")),
                  "checkpoint save");
  }
  detail::SaveSetup setup =
      detail::prepare_save(c, mesh, model, optimizer, step, metadata, rng_state, checked);
  st->dir = dir;
  st->options = checked;
  st->index = std::move(setup.index);
  st->fault = setup.fault;
  st->pending = detail::start_save(c, dir, step, st->options);

  // The snapshot: this rank's shards into staging, one copy each.
  const std::exception_ptr err = detail::attempt([&] {
    if (!detail::is_writer(mesh)) return;
    const std::vector<const detail::SaveEntry*> to_write =
        detail::entries_to_write(mesh, setup.entries);
    std::uint64_t total = 0;
    for (const detail::SaveEntry* e : to_write)
      total += e->local.nbytes();
    const Tensor buffer = staging_buffer(total, "checkpoint::save_async").first;
    const auto at = reinterpret_cast<std::uintptr_t>(buffer.data());
    char* base = static_cast<char*>(buffer.data()) +
                 (detail::kDirectAlign - at % detail::kDirectAlign) % detail::kDirectAlign;
    st->image = base;
    std::uint64_t offset = 0;
    [[maybe_unused]] bool synced = false;
    for (const detail::SaveEntry* e : to_write) {
      st->fault.maybe_throw("prepare_tensor");
      detail::SaveEntry s;
      s.info = e->info;
      s.layout = e->layout;
      s.local = Tensor::from_owner(buffer.owner(), base + offset, e->local.shape(),
                                   e->local.dtype(), MemorySpace::host);
      std::vector<std::uint32_t> crcs;
      if (e->local.space() == MemorySpace::host) {
        // The copy and the checksum in one pass (the writer would read staging again).
#if defined(KOKKOS_ENABLE_CUDA)
        // Pinned host shards may be written by kernels on the compute stream.
        if (!synced) mesh.compute_stream().synchronize();
        synced = true;
#endif
        const auto* src = static_cast<const char*>(e->local.data());
        const std::uint64_t n = e->local.nbytes();
        for (std::uint64_t b = 0; b < n; b += st->index.block_bytes) {
          const auto len = static_cast<std::size_t>(std::min(st->index.block_bytes, n - b));
          crcs.push_back(checkpoint::detail::copy_crc32c(base + offset + b, src + b, len));
        }
      } else {
        ::fullshard::detail::copy_on_stream(s.local, e->local,
                                            mesh.compute_stream().native_handle(),
                                            "checkpoint::save_async: '" + e->info.name + "'");
      }
      offset += e->local.nbytes();
      st->staged.push_back(std::move(s));
      st->block_crcs.push_back(std::move(crcs));
    }
    st->staging_bytes = total;
    st->file = detail::rank_file(mesh.coordinates().back());
  });
  detail::agree_or_abandon(c, err, st->pending);

  st->snapshot_s = seconds_since(t0);
  if (st->file.empty())
    st->written.store(true, std::memory_order_release);  // nothing to write here
  else
    st->writer = std::thread([s = st.get()] { s->write(); });
  {
    InFlight& f = in_flight();
    std::lock_guard<std::mutex> lock(f.mutex);
    f.save = st;
  }
  return AsyncSave(std::move(st));
}

std::uint64_t reserve_async_staging(graph::Module& model, const optim::Optimizer* optimizer) {
  const char* const what = "checkpoint::reserve_async_staging";
  const DeviceMesh& mesh = detail::model_mesh(model, what);
  if (!detail::is_writer(mesh)) return 0;
  const std::vector<detail::SaveEntry> entries =
      detail::collect_entries(model, optimizer, /*future_state=*/true);
  std::uint64_t total = 0;
  for (const detail::SaveEntry* e : detail::entries_to_write(mesh, entries))
    total += static_cast<std::uint64_t>(e->layout.local_numel()) * dtype_size(e->info.dtype);
  const auto [buffer, fresh] = staging_buffer(total, what);
  if (fresh) std::memset(buffer.data(), 0, buffer.nbytes());  // the pages faulted in now
  return total;
}

}  // namespace fullshard::checkpoint
