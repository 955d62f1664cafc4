// save() and load(): the collective half of the checkpoint layer. Every phase that can fail on
// one rank ends in agree(): one all-reduce tells every rank whether any failed, and then every
// rank throws the first failing rank's error, so no rank is left waiting in a collective.
// Every MPI operation is nonblocking and completed by Comm::wait under the mesh's timeout
// (FULLSHARD_TIMEOUT): a rank that never arrives (killed, stuck, or failed outside an
// agreement) aborts the job with a message naming the operation and the checkpoint.
#include "fullshard/checkpoint/checkpoint.hpp"

#include <mpi.h>
#if defined(__linux__)
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <map>
#include <thread>
#include <unordered_map>

#include "fullshard/base/error.hpp"
#include "fullshard/checkpoint/checksum.hpp"
#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/fsdp/state_dict.hpp"
#include "fullshard/runtime/settings.hpp"
#include "lib/base/message_of.hpp"
#include "lib/base/mpi_wait.hpp"
#include "lib/checkpoint/collective.hpp"
#include "lib/checkpoint/index_json.hpp"
#include "lib/checkpoint/io.hpp"
#include "lib/checkpoint/owner_lock.hpp"
#include "lib/checkpoint/save_parts.hpp"
#include "lib/fsdp/group_access.hpp"
#include "lib/tensor/staging.hpp"

namespace fullshard::checkpoint {

using nlohmann::json;

namespace detail {

const DeviceMesh& model_mesh(graph::Module& model, const char* what) {
  const DeviceMesh* mesh = nullptr;
  std::string first;
  for (graph::Module* m : model.modules_preorder())
    if (fsdp::FSDPModule* st = fsdp::fsdp_state(*m)) {
      if (!mesh) {
        mesh = &st->mesh();
        first = m->fqn();
      } else if (st->mesh().describe() != mesh->describe()) {
        throw InvalidArgument(std::string(what) + ": modules '" + first + "' and '" + m->fqn() +
                              "' are sharded over different meshes (" + mesh->describe() + " and " +
                              st->mesh().describe() + "); checkpoints need one mesh");
      }
    }
  for (graph::Module* m = model.parent(); !mesh && m; m = m->parent())
    if (fsdp::FSDPModule* st = fsdp::fsdp_state(*m)) mesh = &st->mesh();
  if (!mesh)
    throw InvalidArgument(std::string(what) +
                          ": no module of the model is fully_shard'ed, so "
                          "there is no mesh to save or load over");
  return *mesh;
}

bool is_writer(const DeviceMesh& mesh) {
  const auto& c = mesh.coordinates();
  return std::all_of(c.begin(), c.end() - 1, [](int x) { return x == 0; });
}

std::string rank_file(int shard_rank) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank-%05d.bin", shard_rank);
  return buf;
}

}  // namespace detail

namespace {

using detail::advise_huge_pages;
using detail::agree;
using detail::agree_or_abandon;
using detail::attempt;
using detail::bcast_string;
using detail::Comm;
using detail::is_writer;
using detail::model_mesh;
using detail::SaveEntry;
using Entry = detail::SaveEntry;

std::string relative_name(const graph::Module& model, const graph::Parameter& p) {
  return model.fqn().empty() ? p.fqn() : p.fqn().substr(model.fqn().size() + 1);
}

// With `future_state`, optimizer state not made yet gets an entry without a tensor (f32, the
// shard's layout: what the first step makes).
std::vector<Entry> collect(graph::Module& model, const optim::Optimizer* opt,
                           bool future_state = false) {
  std::vector<Entry> out;
  const auto sd = fsdp::sharded_state_dict(model);
  std::unordered_map<const graph::Parameter*, std::string> names;
  for (graph::Parameter* p : model.parameters()) {
    const std::string key = relative_name(model, *p);
    names[p] = key;
    const ShardedTensor& st = sd.at(key);
    Entry e;
    e.info.name = e.info.param = key;
    e.info.dtype = p->dtype();
    e.info.global_shape = p->shape();
    e.info.placement = st.placement();
    e.local = st.local;
    e.layout = st.layout;
    out.push_back(std::move(e));
  }
  if (!opt) return out;
  const auto views = opt->state_views();
  for (const graph::Parameter* p : opt->params()) {
    auto it = names.find(p);
    if (it == names.end())
      throw InvalidArgument("checkpoint::save: the optimizer's parameter '" + p->fqn() +
                            "' is not a parameter of the model");
    const ShardedTensor& st = sd.at(it->second);
    for (const std::string& s : opt->state_names()) {
      auto v = views.find(p->fqn() + "." + s);
      if (v == views.end()) {  // no state yet
        if (!future_state) continue;
        Entry e;
        e.info.name = it->second + "." + s;
        e.info.param = it->second;
        e.info.state = s;
        e.info.dtype = DType::f32;
        e.info.global_shape = p->shape();
        e.info.placement = st.placement();
        e.layout = st.layout;
        out.push_back(std::move(e));
        continue;
      }
      if (v->second.shape() != st.layout.local_shape)
        throw InvalidArgument("checkpoint::save: optimizer state '" + v->first + "' has shape " +
                              shape_string(v->second.shape()) + ", the parameter's shard is " +
                              shape_string(st.layout.local_shape));
      Entry e;
      e.info.name = it->second + "." + s;
      e.info.param = it->second;
      e.info.state = s;
      e.info.dtype = v->second.dtype();
      e.info.global_shape = p->shape();
      e.info.placement = st.placement();
      e.local = v->second;
      e.layout = st.layout;
      out.push_back(std::move(e));
    }
  }
  return out;
}

// Host bytes of the tensors to save: device shards (and their optimizer state) are copied on
// the mesh's compute stream (after the optimizer's kernels) into one reused pinned buffer.
using Stager = ::fullshard::detail::HostStager;
Stager stager(const DeviceMesh& mesh) {
  return Stager(mesh.compute_stream().native_handle());
}

json shard_json(const std::string& name, const ShardInfo& s) {
  return {{"tensor", name},     {"offset", s.offset},
          {"length", s.length}, {"global_offset", s.global_offset},
          {"shape", s.shape},   {"crc32c", s.crc32c}};
}

Index base_index(const std::vector<Entry>& entries, const DeviceMesh& mesh,
                 const optim::Optimizer* opt, Kind kind, std::int64_t step, const json& metadata,
                 const std::string& rng, std::uint64_t block, const std::string& run,
                 const std::vector<std::string>& lineage) {
  Index x;
  x.kind = kind;
  x.step = step;
  x.block_bytes = block;
  x.metadata = metadata.dump();
  x.rng_state = rng;
  if (opt) {
    x.has_optimizer = true;
    x.optimizer_step = opt->steps();
    x.optimizer_state_names = opt->state_names();
  }
  json by = {
      {"world_size", mesh.size()}, {"mesh_shape", mesh.shape()}, {"mesh_names", mesh.names()}};
  if (!run.empty()) {  // the run and its lineage: whose retention may delete it
    by["run"] = run;
    by["lineage"] = lineage;
  }
  x.saved_by = by.dump();
  for (const Entry& e : entries)
    x.tensors.push_back(e.info);
  x.model_fingerprint = model_fingerprint(x);
  return x;
}

// Rank 0 commits (index, renames, latest); every rank learns the result.
std::string finish_save(Comm& c, const detail::PendingStep& pending, Index& index,
                        const detail::Fault& fault) {
  std::string final_dir;
  std::exception_ptr err;
  if (c.rank() == 0) {
    err = attempt([&] { final_dir = detail::commit_step(pending, to_json(index).dump(1), fault); });
    if (err) detail::abandon_step(pending);
  }
  agree(c, err, "checkpoint save");
  bcast_string(c, final_dir, 0);
  return final_dir;
}

// Bytes per message of a full save; also rank 0's buffer for a shard that is not contiguous in
// the full tensor (Shard(d > 0)), received one message at a time and scattered.
constexpr std::uint64_t kMessageBytes = std::uint64_t{64} << 20;

void send_bytes(Comm& c, const void* data, std::uint64_t n, int dest) {
  const auto* p = static_cast<const char*>(data);
  for (std::uint64_t done = 0; done < n;) {
    const int len = static_cast<int>(std::min(n - done, kMessageBytes));
    c.run(
        "MPI_Isend",
        [&](MPI_Request* r) { return MPI_Isend(p + done, len, MPI_BYTE, dest, 0, c.get(), r); },
        dest);
    done += static_cast<std::uint64_t>(len);
  }
}

// Receives the n bytes of the shard `runs` places into `full` from rank `src`: straight into
// place when the shard is one run of the full tensor (Shard(0)), else through `piece`.
void recv_shard(Comm& c, int src, detail::BoxRuns runs, std::uint64_t n, char* full,
                detail::ByteBuffer& piece) {
  const bool direct = runs.count() == 1;
  for (std::uint64_t done = 0; done < n;) {
    const int len = static_cast<int>(std::min(n - done, kMessageBytes));
    char* dst = direct ? full + runs.run().dst + done : piece.data();
    c.run(
        "MPI_Irecv",
        [&](MPI_Request* r) { return MPI_Irecv(dst, len, MPI_BYTE, src, 0, c.get(), r); }, src);
    if (!direct) runs.copy(piece.data(), done, done + static_cast<std::uint64_t>(len), full);
    done += static_cast<std::uint64_t>(len);
  }
}

std::string save_full(Comm& c, const DeviceMesh& mesh, std::vector<Entry>& entries, Index& index,
                      const detail::PendingStep& pending, const detail::Fault& fault) {
  // The shard group of replicate row 0 gathers each tensor to rank 0, which writes it. Per
  // tensor, every rank of the group first prepares what can fail (rank 0: the layouts and its
  // buffer; the others: a host copy of their shard), then the group agrees that every rank is
  // ready, and only then do the shards move: a failure (out of memory, a failed device copy)
  // stops the whole group before any send, so no rank waits for a message that never comes.
  // The failing rank's error is then agreed over the world.
  std::unique_ptr<Comm> row;
  if (is_writer(mesh))
    row = detail::checkpoint_comm(mesh.control_comm(mesh.names().back()), mesh.timeout_s(),
                                  c.where());
  std::exception_ptr err;
  bool stopped = false;  // the group agreed to stop after a failure (maybe another rank's)
  std::unique_ptr<detail::DataFileWriter> w;
  if (c.rank() == 0)
    err = attempt([&] {
      w = std::make_unique<detail::DataFileWriter>(detail::join(pending.tmp, "model.bin"),
                                                   index.block_bytes, fault);
    });
  auto append = [&](const void* data, TensorInfo& t) {
    if (t.bytes() == 0) return;
    ShardInfo s;
    s.global_offset.assign(t.global_shape.size(), 0);
    s.shape = t.global_shape;
    w->append(data, t.bytes(), s, t.name);
    t.shards.push_back(std::move(s));
  };
  detail::ByteBuffer full, piece;  // rank 0: grown, never zero-filled
  Stager stage = stager(mesh);
  for (std::size_t i = 0; row && !stopped && i < entries.size(); ++i) {
    const Entry& e = entries[i];
    TensorInfo& t = index.tensors[i];
    const std::size_t es = dtype_size(t.dtype);
    if (e.info.placement.is_replicate()) {  // rank 0 holds all of it: nothing moves
      if (row->rank() == 0 && !err)
        err = attempt([&] {
          fault.maybe_throw("prepare_tensor");
          append(stage.host_of(e.local, "checkpoint::save: '" + e.info.name + "'").data(), t);
        });
      continue;
    }
    Tensor h;                          // this rank's shard in host memory
    std::vector<ShardLayout> layouts;  // rank 0: every rank's shard
    if (!err)
      err = attempt([&] {
        fault.maybe_throw("prepare_tensor");
        if (e.layout.local_numel() > 0)
          h = stage.host_of(e.local, "checkpoint::save: '" + e.info.name + "'");
        if (row->rank() != 0) return;
        std::uint64_t piece_bytes = 0;
        const std::vector<std::int64_t> zero(t.global_shape.size(), 0);
        for (int q = 0; q < row->size(); ++q) {
          layouts.push_back(
              q == 0 ? e.layout
                     : shard_layout(t.global_shape, t.placement, row->size(), q, t.name));
          const ShardLayout& l = layouts.back();
          const detail::BoxRuns runs(l.global_offset, l.local_shape, zero, t.global_shape, es);
          if (q > 0 && runs.count() > 1)
            piece_bytes =
                std::max(piece_bytes,
                         std::min(kMessageBytes, static_cast<std::uint64_t>(l.local_numel()) * es));
        }
        full.resize(static_cast<std::size_t>(t.bytes()));
        if (piece.size() < piece_bytes) piece.resize(static_cast<std::size_t>(piece_bytes));
      });
    if (row->allreduce(err ? 1 : 0, MPI_MAX, "MPI_Iallreduce (full save: ready to send)") != 0) {
      stopped = true;
      break;
    }
    err = attempt([&] {
      if (row->rank() != 0) {
        if (e.layout.local_numel() > 0) send_bytes(*row, h.data(), h.nbytes(), 0);
        return;
      }
      const std::vector<std::int64_t> zero(t.global_shape.size(), 0);
      for (int q = 0; q < row->size(); ++q) {
        const ShardLayout& l = layouts[static_cast<std::size_t>(q)];
        if (l.local_numel() == 0) continue;
        detail::BoxRuns runs(l.global_offset, l.local_shape, zero, t.global_shape, es);
        const std::uint64_t n = static_cast<std::uint64_t>(l.local_numel()) * es;
        if (q == 0)
          runs.copy(static_cast<const char*>(h.data()), 0, n, full.data());
        else
          recv_shard(*row, q, std::move(runs), n, full.data(), piece);
      }
      append(full.data(), t);
    });
  }
  if (c.rank() == 0 && !err && !stopped)
    err = attempt([&] {
      w->finish();
      index.files.push_back({"model.bin", w->bytes()});
      index = index_from_json(to_json(index), detail::join(pending.tmp, kIndexFile));
    });
  agree_or_abandon(c, err, pending);
  return finish_save(c, pending, index, fault);
}

}  // namespace

namespace detail {

std::vector<SaveEntry> collect_entries(graph::Module& model, const optim::Optimizer* optimizer,
                                       bool future_state) {
  return collect(model, optimizer, future_state);
}

SaveSetup prepare_save(Comm& c, const DeviceMesh& mesh, graph::Module& model,
                       const optim::Optimizer* optimizer, std::int64_t step,
                       const std::string& metadata_text, const std::string& rng_state,
                       const SaveOptions& options) {
  SaveSetup s;
  std::exception_ptr err = attempt([&] {
    if (options.block_bytes == 0 || options.block_bytes > kMaxBlockBytes)
      throw InvalidArgument("checkpoint::save: block_bytes must be in [1, " +
                            std::to_string(kMaxBlockBytes) + "], got " +
                            std::to_string(options.block_bytes));
    const json metadata = parse_metadata(metadata_text, "checkpoint::save");
    if (step < 0)
      throw InvalidArgument("checkpoint::save: step must be >= 0, got " + std::to_string(step));
    if (options.keep_last < 0)
      throw InvalidArgument("checkpoint::save: keep_last must be >= 0 (0 keeps all), got " +
                            std::to_string(options.keep_last));
    s.fault = Fault::from_environment();
    s.entries = collect(model, optimizer);
    s.index = base_index(s.entries, mesh, optimizer, options.kind, step, metadata, rng_state,
                         options.block_bytes, options.run, options.lineage);
  });
  agree(c, err, "checkpoint save");
  return s;
}

PendingStep start_save(Comm& c, const std::string& dir, std::int64_t step,
                       const SaveOptions& options) {
  PendingStep p;
  std::exception_ptr err;
  if (c.rank() == 0)
    err = attempt([&] {
      check_not_held_by_another(dir, options.run);  // before begin_step removes leftovers
      p = begin_step(dir, step);
    });
  agree(c, err, "checkpoint save");
  bcast_string(c, p.tmp, 0);
  p.root = dir;
  p.step = step;
  return p;
}

void agree_or_abandon(Comm& c, const std::exception_ptr& err, const PendingStep& p) {
  try {
    agree(c, err, "checkpoint save");
  } catch (...) {
    if (c.rank() == 0) abandon_step(p);
    throw;
  }
}

std::vector<const SaveEntry*> entries_to_write(const DeviceMesh& mesh,
                                               const std::vector<SaveEntry>& entries) {
  std::vector<const SaveEntry*> out;
  for (const SaveEntry& e : entries) {
    if (e.info.placement.is_replicate() && mesh.rank() != 0) continue;  // one copy suffices
    if (e.layout.local_numel() == 0) continue;
    out.push_back(&e);
  }
  return out;
}

std::string write_shards(const std::vector<const SaveEntry*>& entries, const std::string& file,
                         std::uint64_t block_bytes, const std::string& tmp, const Fault& fault,
                         const std::function<const void*(const SaveEntry&)>& host_of) {
  DataFileWriter w(join(tmp, file), block_bytes, fault);
  json shards = json::array();
  for (const SaveEntry* e : entries) {
    const void* data = host_of(*e);
    ShardInfo s;
    s.global_offset = e->layout.global_offset;
    s.shape = e->layout.local_shape;
    w.append(data, static_cast<std::uint64_t>(e->layout.local_numel()) * dtype_size(e->info.dtype),
             s, e->info.name);
    shards.push_back(shard_json(e->info.name, s));
  }
  w.finish();
  return json{{"file", file}, {"bytes", w.bytes()}, {"shards", std::move(shards)}}.dump();
}

std::string write_image(const std::vector<SaveEntry>& entries,
                        const std::vector<std::vector<std::uint32_t>>& block_crcs,
                        const char* image, std::uint64_t n, const std::string& file,
                        std::uint64_t block_bytes, const std::string& tmp, const Fault& fault) {
  json shards = json::array();
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const SaveEntry& e = entries[i];
    const auto* p = static_cast<const char*>(e.local.data());
    ShardInfo s;
    s.global_offset = e.layout.global_offset;
    s.shape = e.layout.local_shape;
    s.offset = static_cast<std::uint64_t>(p - image);
    s.length = e.local.nbytes();
    if (i < block_crcs.size() && !block_crcs[i].empty())
      s.crc32c = block_crcs[i];
    else
      for (std::uint64_t b = 0; b < s.length; b += block_bytes)
        s.crc32c.push_back(
            crc32c(p + b, static_cast<std::size_t>(std::min(block_bytes, s.length - b))));
    shards.push_back(shard_json(e.info.name, s));
  }
  write_file_image(join(tmp, file), image, n, fault);
  return json{{"file", file}, {"bytes", n}, {"shards", std::move(shards)}}.dump();
}

std::string commit_sharded(Comm& c, const std::string& record, Index& index,
                           const PendingStep& pending, const Fault& fault) {
  // Rank 0 gathers the records and builds the index. (int counts: a record is ~100 bytes per
  // shard plus ~11 per MiB of data, far from 2 GiB.)
  int len = static_cast<int>(record.size());
  std::vector<int> lens(c.rank() == 0 ? static_cast<std::size_t>(c.size()) : 0);
  c.run("MPI_Igather", [&](MPI_Request* r) {
    return MPI_Igather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, 0, c.get(), r);
  });
  std::vector<int> displs(lens.size());
  std::string all;
  if (c.rank() == 0) {
    long long total = 0;
    for (std::size_t r = 0; r < lens.size(); ++r) {
      displs[r] = static_cast<int>(total);
      total += lens[r];
    }
    all.resize(static_cast<std::size_t>(total));
  }
  c.run("MPI_Igatherv", [&](MPI_Request* r) {
    return MPI_Igatherv(record.data(), len, MPI_CHAR, all.data(), lens.data(), displs.data(),
                        MPI_CHAR, 0, c.get(), r);
  });
  std::exception_ptr err;
  if (c.rank() == 0) {
    err = attempt([&] {
      std::unordered_map<std::string, TensorInfo*> by_name;
      for (TensorInfo& t : index.tensors)
        by_name[t.name] = &t;
      std::map<std::string, json> records;  // by file name: deterministic order
      for (std::size_t r = 0; r < lens.size(); ++r)
        if (lens[r] > 0) {
          json j = json::parse(
              all.substr(static_cast<std::size_t>(displs[r]), static_cast<std::size_t>(lens[r])));
          const std::string file = j["file"].get<std::string>();
          records[file] = std::move(j);
        }
      for (auto& [name, j] : records) {
        const std::size_t file = index.files.size();
        index.files.push_back({name, j["bytes"].get<std::uint64_t>()});
        for (const json& s : j["shards"]) {
          auto it = by_name.find(s["tensor"].get<std::string>());
          if (it == by_name.end())
            throw InvalidArgument("checkpoint save: " + name + " holds tensor '" +
                                  s["tensor"].get<std::string>() +
                                  "', which rank 0 does not have (optimizer state differs "
                                  "across ranks?)");
          ShardInfo si;
          si.file = file;
          si.offset = s["offset"].get<std::uint64_t>();
          si.length = s["length"].get<std::uint64_t>();
          si.global_offset = s["global_offset"].get<std::vector<std::int64_t>>();
          si.shape = s["shape"].get<Shape>();
          si.crc32c = s["crc32c"].get<std::vector<std::uint32_t>>();
          it->second->shards.push_back(std::move(si));
        }
      }
      // What a loader will check, checked now: the shards tile every tensor.
      index = index_from_json(to_json(index), join(pending.tmp, kIndexFile));
    });
    if (err) abandon_step(pending);
  }
  agree(c, err, "checkpoint save");
  return finish_save(c, pending, index, fault);
}

void apply_retention(Comm& c, const std::string& dir, const SaveOptions& options) {
  if (options.keep_last <= 0 || c.rank() != 0) return;
  for (const std::string& problem : prune_steps(dir, options.keep_last, options.keep,
                                                options.run.empty() ? nullptr : &options.lineage))
    std::fprintf(stderr, "fullshard[rank 0]: warning: checkpoint retention: %s\n", problem.c_str());
}

void advise_huge_pages(const Tensor& t) noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr std::uintptr_t kHuge = 2u << 20;
  const auto begin = reinterpret_cast<std::uintptr_t>(t.data());
  const std::uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);
  const std::uintptr_t last = (begin + t.nbytes()) & ~(kHuge - 1);
  if (t.space() == MemorySpace::host && last > first)
    ::madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#else
  (void)t;
#endif
}

}  // namespace detail

std::string save(const std::string& dir, graph::Module& model, const optim::Optimizer* optimizer,
                 std::int64_t step, const std::string& metadata, const std::string& rng_state,
                 const SaveOptions& options) {
  const DeviceMesh& mesh = detail::model_mesh(model, "checkpoint::save");
  const std::unique_ptr<Comm> comm = detail::checkpoint_comm(mesh.control_world(), mesh.timeout_s(),
                                                             "checkpoint save of '" + dir + "'");
  Comm& c = *comm;
  detail::complete_async_save();  // at most one save in flight; its error is raised here
  detail::SaveSetup setup =
      detail::prepare_save(c, mesh, model, optimizer, step, metadata, rng_state, options);
  const detail::PendingStep pending = detail::start_save(c, dir, step, options);
  std::string final_dir;
  if (options.kind == Kind::full) {
    final_dir = save_full(c, mesh, setup.entries, setup.index, pending, setup.fault);
  } else {
    // Every writer writes its shards into its own file (device shards staged one at a time).
    std::string record;
    const std::exception_ptr err = attempt([&] {
      if (!detail::is_writer(mesh)) return;
      Stager stage = stager(mesh);
      record = detail::write_shards(
          detail::entries_to_write(mesh, setup.entries),
          detail::rank_file(mesh.coordinates().back()), setup.index.block_bytes, pending.tmp,
          setup.fault, [&](const SaveEntry& e) {
            setup.fault.maybe_throw("prepare_tensor");
            return stage.host_of(e.local, "checkpoint::save: '" + e.info.name + "'").data();
          });
    });
    agree_or_abandon(c, err, pending);
    final_dir = detail::commit_sharded(c, record, setup.index, pending, setup.fault);
  }
  detail::apply_retention(c, dir, options);
  return final_dir;
}

// ---- load -------------------------------------------------------------------------------------

namespace {

std::string fingerprint_note(const Index& index, const std::string& mine) {
  if (index.model_fingerprint == mine) return "";
  return " (model fingerprint " + index.model_fingerprint + ", this model's is " + mine +
         ": saved from another model?)";
}

// A load runs in four phases: validate (the index against the model and the optimizer),
// allocate (fresh memory for everything it reads), read_shards (this rank's boxes, verified)
// and, after every rank has agreed that those three succeeded, commit (the model and the
// optimizer take the new state). The first three only touch memory of their own, so a failure
// anywhere leaves the model as it was; the last cannot fail halfway.

// What validate() found: the index, and the tensor of every parameter and optimizer state the
// load reads.
struct LoadPlan {
  Index index;
  std::string what;  // "checkpoint <step dir>/index.json", for messages
  /// Every parameter of the model, by its name relative to the model.
  std::unordered_map<const graph::Parameter*, std::string> names;
  /// Index tensors by name (pointers into index.tensors).
  std::unordered_map<std::string, const TensorInfo*> by_name;
  /// The optimizer states to load: (state dict key "<fqn>.<state>", tensor, parameter name).
  struct State {
    std::string key;
    const TensorInfo* tensor;
    std::string param;
  };
  std::vector<State> states;
};

// Where a parameter's shard goes: a slot of its group's new sharded storage (host groups:
// the load reads straight into memory the model then adopts), or its own staging tensor
// (parameters outside any group, and groups in device memory), copied in after agreement.
struct GroupTarget {
  fsdp::FSDPModule* group = nullptr;  // the group's first module
  Tensor storage;                     // fresh, same shape/dtype as the group's sharded storage
};

// What allocate() made: the destination of every box read() reads.
struct LoadTargets {
  std::vector<GroupTarget> groups;
  struct Param {
    const graph::Parameter* param;
    const TensorInfo* tensor;
    ShardLayout layout;
    std::size_t group;  // index into groups, or npos: staged
    std::int64_t slot;  // element offset in groups[group].storage
  };
  std::vector<Param> params;  // in name order, as the index lists them
  std::unordered_map<const graph::Parameter*, Tensor> staged;
  /// The optimizer's new state dict, and the box of each state to read into it.
  std::map<std::string, Tensor> opt_state;
  std::vector<std::pair<const TensorInfo*, ShardLayout>> state_reads;  // same order as keys
  std::vector<std::string> state_keys;
};

// Checks the index against the model (every parameter present with its shape and dtype, no
// other, same fingerprint) and against the optimizer (state names, states only of its
// parameters, f32 with the parameter's shape, all of a parameter's states or none).
LoadPlan validate(const std::string& step_dir, const std::string& text, graph::Module& model,
                  const optim::Optimizer* optimizer) {
  LoadPlan plan;
  const std::string where = detail::join(step_dir, kIndexFile);
  plan.index = parse_index(text, where);  // validate_index: every field against the others
  const Index& index = plan.index;
  const std::string& what = plan.what = "checkpoint " + where;
  std::map<std::string, std::pair<DType, Shape>> model_params;
  for (graph::Parameter* p : model.parameters()) {
    const std::string& name = plan.names[p] = relative_name(model, *p);
    model_params[name] = {p->dtype(), p->shape()};
  }
  const std::string note = fingerprint_note(index, model_fingerprint(model_params));
  for (const TensorInfo& t : index.tensors)
    plan.by_name[t.name] = &t;
  for (const auto& [name, ds] : model_params) {
    auto it = plan.by_name.find(name);
    if (it == plan.by_name.end())
      throw InvalidArgument(what + ": the model's parameter '" + name + "' is missing" + note);
    const TensorInfo& t = *it->second;
    if (t.global_shape != ds.second)
      throw InvalidArgument(what + ": tensor '" + name + "' has shape " +
                            shape_string(t.global_shape) + ", the model's parameter is " +
                            shape_string(ds.second) + note);
    if (t.dtype != ds.first)
      throw InvalidArgument(what + ": tensor '" + name + "' is " + dtype_name(t.dtype) +
                            ", the model's parameter is " + dtype_name(ds.first) + note);
  }
  for (const TensorInfo& t : index.tensors)
    if (t.is_param() && !model_params.count(t.name))
      throw InvalidArgument(what + ": unexpected parameter '" + t.name +
                            "': the model has no such parameter" + note);
  if (!note.empty()) throw InvalidArgument(what + note);
  if (!optimizer) return plan;

  if (!index.has_optimizer)
    throw InvalidArgument(what +
                          " holds no optimizer state (saved without an optimizer); "
                          "load it with optimizer = nullptr");
  const auto want = optimizer->state_names();
  // Names without tensors constrain nothing: an SGD without momentum saved through LibTorch's
  // optimizer names its (never made) momentum buffer, fullshard's SGD names none.
  const bool holds_state = std::any_of(index.tensors.begin(), index.tensors.end(),
                                       [](const TensorInfo& t) { return !t.is_param(); });
  if (want != index.optimizer_state_names && holds_state) {
    auto list = [](const std::vector<std::string>& v) {
      std::string s;
      for (const auto& x : v)
        s += (s.empty() ? "" : ", ") + x;
      return "[" + s + "]";
    };
    throw InvalidArgument(what + ": optimizer state names " + list(index.optimizer_state_names) +
                          " differ from this optimizer's " + list(want) +
                          " (another optimizer class, or SGD with and without momentum?)");
  }
  std::vector<std::pair<const graph::Parameter*, std::string>> opt_params;
  std::unordered_map<std::string, int> held;
  for (const graph::Parameter* p : optimizer->params()) {
    auto it = plan.names.find(p);
    if (it == plan.names.end())
      throw InvalidArgument("checkpoint::load: the optimizer's parameter '" + p->fqn() +
                            "' is not a parameter of the model");
    held[it->second] = 1;
    opt_params.emplace_back(p, it->second);
  }
  for (const TensorInfo& t : index.tensors) {
    if (t.is_param()) continue;
    if (!held.count(t.param))
      throw InvalidArgument(what + ": optimizer state '" + t.name +
                            "' belongs to a parameter this optimizer does not hold");
    if (t.dtype != DType::f32 || t.global_shape != model_params.at(t.param).second)
      throw InvalidArgument(what + ": optimizer state '" + t.name + "' is " + dtype_name(t.dtype) +
                            " " + shape_string(t.global_shape) + ", expected f32 " +
                            shape_string(model_params.at(t.param).second));
  }
  for (const auto& [p, name] : opt_params) {
    std::size_t present = 0;
    for (const std::string& s : index.optimizer_state_names)
      present += plan.by_name.count(name + "." + s);
    if (present == 0) continue;  // no state for it (torch semantics)
    for (const std::string& s : index.optimizer_state_names) {
      auto it = plan.by_name.find(name + "." + s);
      if (it == plan.by_name.end())
        throw InvalidArgument(what + ": optimizer state '" + name + "." + s +
                              "' is missing (the parameter has its other states)");
      plan.states.push_back({p->fqn() + "." + s, it->second, name});
    }
  }
  return plan;
}

// Fresh memory for everything read() reads: new sharded storage for every host group (its
// padding zeroed: the storage's invariant), a staging tensor for every other parameter and
// for every optimizer state. Nothing in the model changes here.
LoadTargets allocate(const LoadPlan& plan, graph::Module& model,
                     const optim::Optimizer* optimizer) {
  LoadTargets out;
  std::unordered_map<const graph::Parameter*, std::pair<std::size_t, std::int64_t>> slot_of;
  for (graph::Module* m : model.modules_preorder()) {
    fsdp::FSDPModule* st = fsdp::fsdp_state(*m);
    if (!st || !fsdp::detail::owns_group(*st)) continue;  // a list group: once, at its first module
    fsdp::FSDPModule* g = st;
    const Tensor& storage = fsdp::detail::sharded_storage(*g);
    if (storage.space() != MemorySpace::host) continue;
    Tensor fresh = Tensor::empty(storage.shape(), storage.dtype(), MemorySpace::host,
                                 "checkpoint.load " + fsdp::detail::group_name(*g));
    advise_huge_pages(fresh);
    const std::string problem = fsdp::detail::adopt_problem(*g, fresh);
    if (!problem.empty()) throw InvalidArgument("checkpoint::load: " + problem);
    const std::size_t es = dtype_size(fresh.dtype());
    std::int64_t covered = 0;
    auto* base = static_cast<unsigned char*>(fresh.data());
    const auto& members = g->group_layout().members;
    for (std::size_t i = 0; i < members.size(); ++i) {
      const std::int64_t off = members[i].slot_offset;
      if (off > covered)
        std::memset(base + covered * es, 0, static_cast<std::size_t>(off - covered) * es);
      covered = off + numel(members[i].layout.local_shape);
      slot_of[fsdp::detail::group_params(*g)[i]] = {out.groups.size(), off};
    }
    if (fresh.numel() > covered)
      std::memset(base + covered * es, 0, static_cast<std::size_t>(fresh.numel() - covered) * es);
    out.groups.push_back({g, std::move(fresh)});
  }
  // Host memory to read into; pinned for a device shard (copied there at commit).
  auto staging = [](const TensorInfo& t, const ShardLayout& l, MemorySpace target) {
    if (target == MemorySpace::device)
      return ::fullshard::detail::pinned_host_tensor(l.local_shape, t.dtype, "checkpoint.load");
    Tensor s = Tensor::empty(l.local_shape, t.dtype, MemorySpace::host, "checkpoint.load");
    advise_huge_pages(s);
    return s;
  };
  std::unordered_map<std::string, const graph::Parameter*> param_of;
  for (const auto& [p, name] : plan.names)
    param_of[name] = p;
  const auto sd = fsdp::sharded_state_dict(model);
  for (const auto& [name, st] : sd) {  // in name order, as the index lists them
    const graph::Parameter* p = param_of.at(name);
    const TensorInfo* t = plan.by_name.at(name);
    auto it = slot_of.find(p);
    if (it == slot_of.end()) {
      out.staged[p] = staging(*t, st.layout, st.local.space());
      out.params.push_back({p, t, st.layout, std::string::npos, 0});
    } else {
      out.params.push_back({p, t, st.layout, it->second.first, it->second.second});
    }
  }
  for (const LoadPlan::State& s : plan.states) {
    const ShardLayout& l = sd.at(s.param).layout;
    out.opt_state[s.key] = staging(*s.tensor, l, sd.at(s.param).local.space());
    out.state_reads.emplace_back(s.tensor, l);
    out.state_keys.push_back(s.key);
  }
  if (optimizer) {
    Tensor step = Tensor::zeros({1}, DType::f64);
    step.set(0, static_cast<double>(plan.index.optimizer_step));
    out.opt_state["step"] = step;
  }
  return out;
}

// Reads and verifies this rank's box of every tensor into its target; returns the bytes read.
std::uint64_t read_shards(const LoadPlan& plan, const std::string& step_dir, LoadTargets& targets) {
  Reader reader(step_dir, plan.index);
  for (const LoadTargets::Param& p : targets.params) {
    const Tensor dst = p.group == std::string::npos ? targets.staged.at(p.param)
                                                    : targets.groups[p.group].storage.flat_view(
                                                          p.slot, p.layout.local_shape);
    reader.read_box(*p.tensor, p.layout.global_offset, p.layout.local_shape, dst.data());
  }
  for (std::size_t i = 0; i < targets.state_reads.size(); ++i) {
    const auto& [t, l] = targets.state_reads[i];
    reader.read_box(*t, l.global_offset, l.local_shape,
                    targets.opt_state.at(targets.state_keys[i]).data());
  }
  return reader.bytes_read();
}

// Everything is read and checked on every rank: swap the new storage in, copy the few staged
// parameters, hand the optimizer its state. Nothing here can fail halfway.
// Device shards are copied from their pinned staging on `stream` (the compute stream).
void commit(LoadTargets& targets, optim::Optimizer* optimizer, void* stream) {
  for (GroupTarget& t : targets.groups)
    fsdp::detail::adopt_sharded_storage(*t.group, std::move(t.storage));
  for (const auto& [p, t] : targets.staged)
    if (p->data().space() == MemorySpace::host)
      copy_bytes(p->data(), t);
    else
      ::fullshard::detail::copy_on_stream(p->data(), t, stream,
                                          "checkpoint::load: '" + p->fqn() + "'");
  if (optimizer) optimizer->load_state_dict(std::move(targets.opt_state));
}

}  // namespace

namespace {

// This rank's half of check_directory: create `dir` (not its parents), then a probe file.
void probe_directory(const std::string& dir, int rank) {
  namespace stdfs = std::filesystem;
  std::error_code ec;
  stdfs::path d = stdfs::absolute(dir, ec).lexically_normal();
  if (!d.has_filename()) d = d.parent_path();  // a trailing '/'
  if (!stdfs::exists(d, ec)) {
    const stdfs::path parent = d.parent_path();
    if (!stdfs::is_directory(parent, ec))
      throw ConfigError("checkpoint directory '" + dir + "': its parent '" + parent.string() +
                        "' does not exist (a mistyped path? create the parent first)");
    if (!stdfs::create_directory(d, ec) && !stdfs::is_directory(d))
      throw ConfigError("checkpoint directory '" + dir + "': cannot create it: " +
                        (ec ? ec.message() : std::string("unknown error")));
    detail::fsync_dir(parent.string());
  } else if (!stdfs::is_directory(d, ec)) {
    throw ConfigError("checkpoint directory '" + dir + "' exists and is not a directory");
  }
  const std::string probe = detail::join(d.string(), ".probe-rank" + std::to_string(rank));
  try {
    File f = File::create(probe);
    f.write_all("fullshard\n", 10);
    f.sync();
    f.close();
  } catch (const std::exception& e) {
    detail::remove_quietly(probe);
    throw ConfigError("checkpoint directory '" + dir + "' is not writable (" +
                      ::fullshard::detail::message_of(e) + ")");
  }
  detail::remove_quietly(probe);
}

// That every rank sees the same directory: rank 0 writes a file with a token no earlier run
// wrote (its host, pid and clock), every rank reads it back. A node-local path (/tmp on a
// cluster) passes each rank's own probe but would leave each node's shards on that node.
void check_shared(const std::string& dir, Comm& c) {
  if (c.size() == 1) return;
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  const std::string probe = detail::join(dir, ".probe-shared");
  std::string token = std::string(host) + " pid " + std::to_string(getpid()) + " t " +
                      std::to_string(std::chrono::steady_clock::now().time_since_epoch().count());
  std::exception_ptr err;
  if (c.rank() == 0)
    err = attempt([&] {
      File f = File::create(probe);
      f.write_all(token.data(), token.size());
      f.sync();
      f.close();
    });
  agree(c, err, "checkpoint directory check");
  bcast_string(c, token, 0);
  err = attempt([&] {
    std::string seen;
    std::FILE* f = std::fopen(probe.c_str(), "rb");
    const bool found = f != nullptr;
    if (f) {
      char buf[512];
      const std::size_t n = std::fread(buf, 1, sizeof buf, f);
      std::fclose(f);
      seen.assign(buf, n);
    }
    if (seen != token)
      throw ConfigError("checkpoint directory '" + dir + "' is not shared by the ranks that " +
                        "write it: rank " + std::to_string(c.rank()) + " (host " + host +
                        ") does not see the file rank 0 wrote there (" +
                        (found ? "its content differs" : "no such file") +
                        "); give a directory on a file system every node mounts");
  });
  agree(c, err, "checkpoint directory check");
  if (c.rank() == 0) detail::remove_quietly(probe);
}

}  // namespace

DirectoryCheck check_directory(const std::string& dir, const DeviceMesh& mesh) {
  const std::unique_ptr<Comm> comm = detail::checkpoint_comm(
      mesh.control_world(), mesh.timeout_s(), "checkpoint directory check of '" + dir + "'");
  Comm& c = *comm;
  std::exception_ptr err;
  try {
    probe_directory(dir, c.rank());
  } catch (...) {
    err = std::current_exception();
  }
  agree(c, err, "checkpoint directory check");
  check_shared(dir, c);
  DirectoryCheck out;
  struct statvfs st {};
  if (statvfs(dir.c_str(), &st) == 0 && st.f_frsize > 0)
    out.free_bytes = std::uint64_t(st.f_bavail) * std::uint64_t(st.f_frsize);
  return out;
}

void check_output_file(const std::string& path, const std::string& what, const DeviceMesh& mesh,
                       int writer) {
  namespace stdfs = std::filesystem;
  const std::unique_ptr<Comm> comm = detail::checkpoint_comm(mesh.control_world(), mesh.timeout_s(),
                                                             "output file check of '" + path + "'");
  Comm& c = *comm;
  std::exception_ptr err;
  if (c.rank() == writer)
    err = attempt([&] {
      const std::string name = what + " '" + path + "'";
      if (path.empty()) throw ConfigError(what + ": the path is empty");
      std::error_code ec;
      const stdfs::path p = stdfs::absolute(path, ec).lexically_normal();
      if (!p.has_filename()) throw ConfigError(name + " names a directory, not a file");
      const stdfs::file_status st = stdfs::status(p, ec);
      if (stdfs::exists(st) && !stdfs::is_regular_file(st))
        throw ConfigError(name + " exists and is not a regular file (" +
                          (stdfs::is_directory(st) ? "a directory" : "a special file") + ")");
      const stdfs::path parent = p.parent_path();
      if (!stdfs::is_directory(parent, ec))
        throw ConfigError(name + ": its directory '" + parent.string() +
                          "' does not exist (a mistyped path? create it first)");
      if (stdfs::exists(st) && ::access(p.c_str(), W_OK) != 0)
        throw ConfigError(name + " exists and cannot be written (" + std::strerror(errno) + ")");
      // A probe beside it: the directory takes new files (the file itself is written whole
      // at the end, into a new file renamed over it, or opened for writing).
      const std::string probe =
          (parent / (".fullshard-probe-" + std::to_string(::getpid()))).string();
      try {
        File f = File::create(probe);
        f.write_all("fullshard\n", 10);
        f.close();
      } catch (const std::exception& e) {
        detail::remove_quietly(probe);
        throw ConfigError(name + ": its directory '" + parent.string() + "' is not writable (" +
                          ::fullshard::detail::message_of(e) + ")");
      }
      detail::remove_quietly(probe);
    });
  agree(c, err, (what + " check").c_str());
}

Loaded load(const std::string& dir, graph::Module& model, optim::Optimizer* optimizer) {
  const DeviceMesh& mesh = model_mesh(model, "checkpoint::load");
  const std::unique_ptr<Comm> comm = detail::checkpoint_comm(mesh.control_world(), mesh.timeout_s(),
                                                             "checkpoint load of '" + dir + "'");
  Comm& c = *comm;

  // Rank 0 finds the step directory and reads the index; every rank gets its text.
  std::string step_dir, text;
  std::exception_ptr err;
  if (c.rank() == 0)
    err = attempt([&] {
      step_dir = detail::find_step_dir(dir);
      text = read_index_text(step_dir);  // checked against its checksum file, read once
    });
  agree(c, err, "checkpoint load");
  bcast_string(c, step_dir, 0);
  bcast_string(c, text, 0);

  // Every rank validates, allocates and reads on its own; then all agree.
  Loaded out;
  LoadTargets targets;
  err = attempt([&] {
    const LoadPlan plan = validate(step_dir, text, model, optimizer);
    targets = allocate(plan, model, optimizer);
    out.bytes_read = read_shards(plan, step_dir, targets);
    if (optimizer) optimizer->check_state_dict(targets.opt_state);
    out.step = plan.index.step;
    out.metadata = plan.index.metadata;
    out.rng_state = plan.index.rng_state;
    out.step_dir = step_dir;
    out.kind = plan.index.kind;
  });
  agree(c, err, "checkpoint load");
  commit(targets, optimizer, mesh.compute_stream().native_handle());
  return out;
}

}  // namespace fullshard::checkpoint
