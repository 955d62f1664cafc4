// The C API (include/fullshard/fullshard.h): extern "C" functions over the training session
// (fullshard/session/session.hpp), which does all the work: this file converts arrays and
// handles and maps exceptions to statuses. Every function runs its body through `guarded`
// (lib/capi/status.hpp), which turns every exception into a status and the thread's last-error
// message; no exception crosses the boundary. The sample store's calls are lib/capi/store_api.cpp.
#include "fullshard/fullshard.h"

#include <c10/util/Exception.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "fullshard/base/error.hpp"
#include "fullshard/base/memory_ledger.hpp"
#include "fullshard/mesh/device_mesh.hpp"
#include "fullshard/runtime/runtime.hpp"
#include "fullshard/schedule/auto_plan.hpp"
#include "fullshard/schedule/memory_budget.hpp"
#include "fullshard/session/session.hpp"
#include "fullshard/torch/threads.hpp"
#include "lib/base/json_reader.hpp"
#include "lib/capi/handles.hpp"
#include "lib/capi/status.hpp"
#include "lib/mesh/agreement.hpp"

namespace fs = fullshard;
namespace capi = fullshard::capi;

namespace {

thread_local std::string last_error;

using capi::guarded;
using capi::NotInitialized;

// A model handle's object: the session and the serial number of its asynchronous saves (a
// save handle is finished once its model has started no later one and has none in flight).
struct Model {
  explicit Model(std::unique_ptr<fs::session::Session> s) : session(std::move(s)) {}
  std::unique_ptr<fs::session::Session> session;
  std::uint64_t async_saves = 0;
};

struct Save {
  std::shared_ptr<Model> model;
  std::uint64_t serial = 0;
  bool in_flight() const {
    return model->async_saves == serial && model->session->save_in_flight();
  }
};

struct State {
  std::unique_ptr<fs::Runtime> runtime;
  int rank = -1;  // in init's communicator (error messages)
  capi::HandleTable<fs::DeviceMesh> meshes{1, "mesh"};
  capi::HandleTable<Model> models{2, "model"};
  capi::HandleTable<Save> saves{3, "save",
                                "finished (fullshard_save_test reported it done, or "
                                "fullshard_save_wait returned)"};
};
std::optional<State> state;

State& live() {
  if (!state)
    throw NotInitialized(
        "fullshard is not initialised (call fullshard_init first, and "
        "nothing after fullshard_finalize)");
  return *state;
}

template <class T>
T* required(T* p, const char* what) {
  if (!p) throw fs::InvalidArgument(std::string(what) + " is NULL");
  return p;
}

std::vector<std::string> split_names(const char* names) {
  std::vector<std::string> out(1);
  for (const char* c = names; *c; ++c) {
    if (*c == ',')
      out.emplace_back();
    else if (*c != ' ')
      out.back() += *c;
  }
  return out;
}

fs::DeviceMesh make_mesh(MPI_Comm comm, const char* device, int ndim, const int* shape,
                         const char* names) {
  State& s = live();
  if (comm == MPI_COMM_NULL) throw fs::InvalidArgument("comm is MPI_COMM_NULL");
  if (ndim < 1 || ndim > 2)
    throw fs::InvalidArgument("ndim is " + std::to_string(ndim) +
                              "; a mesh has 1 dim (FSDP) or 2 (HSDP: replicate, shard)");
  required(shape, "shape");
  const std::vector<std::string> dims = split_names(required(names, "names"));
  if (int(dims.size()) != ndim)
    throw fs::InvalidArgument("names \"" + std::string(names) + "\" gives " +
                              std::to_string(dims.size()) + " dim names for ndim " +
                              std::to_string(ndim) + " (separate them with commas)");
  const fs::DeviceType type = fs::parse_device_type(required(device, "device"));
  const fs::Settings& set = s.runtime->settings();
  if (type == fs::DeviceType::cuda)
    return fs::DeviceMesh(type, comm, std::vector<int>(shape, shape + ndim), dims, set.timeout_s);
  return fs::DeviceMesh(comm, std::vector<int>(shape, shape + ndim), dims, set.timeout_s,
                        set.host_progress, set.host_collectives, set.ranks_per_node);
}

// The caller's array as a tensor over its memory (no copy), checked.
at::Tensor view_of(const fullshard_array& a, const std::string& what) {
  if (!a.data) throw fs::InvalidArgument(what + ": data is NULL");
  if (a.ndim < 1 || a.ndim > FULLSHARD_MAX_DIMS)
    throw fs::InvalidArgument(what + ": ndim is " + std::to_string(a.ndim) + "; expected 1 to " +
                              std::to_string(FULLSHARD_MAX_DIMS));
  at::ScalarType t;
  switch (a.dtype) {
    case FULLSHARD_FLOAT32:
      t = at::kFloat;
      break;
    case FULLSHARD_FLOAT64:
      t = at::kDouble;
      break;
    case FULLSHARD_INT32:
      t = at::kInt;
      break;
    case FULLSHARD_INT64:
      t = at::kLong;
      break;
    default:
      throw fs::InvalidArgument(what + ": dtype " + std::to_string(a.dtype) +
                                " is not a fullshard_dtype");
  }
  std::vector<std::int64_t> sizes(a.shape, a.shape + a.ndim);
  bool strided = false;
  for (int d = 0; d < a.ndim; ++d) {
    if (sizes[std::size_t(d)] < 1)
      throw fs::InvalidArgument(what + ": shape[" + std::to_string(d) + "] is " +
                                std::to_string(sizes[std::size_t(d)]) + "; extents must be >= 1");
    strided = strided || a.strides[d] != 0;
  }
  const auto options = at::TensorOptions().dtype(t);
  if (!strided) return ::torch::from_blob(a.data, sizes, options);
  for (int d = 0; d < a.ndim; ++d)
    if (a.strides[d] < 1)
      throw fs::InvalidArgument(what + ": strides[" + std::to_string(d) + "] is " +
                                std::to_string(a.strides[d]) +
                                "; strides are >= 1 (or all 0 for a contiguous array)");
  return ::torch::from_blob(a.data, sizes, std::vector<std::int64_t>(a.strides, a.strides + a.ndim),
                            options);
}

// Inputs in the model's dtype on its device: the caller's memory itself when it is
// contiguous, of that dtype and on the CPU, else one copy (conversion, gathering and the
// host-to-device copy at once).
std::vector<at::Tensor> inputs_of(int n, const fullshard_array* arrays, at::ScalarType want,
                                  const c10::Device& device, const char* what) {
  if (n < 0) throw fs::InvalidArgument(std::string("n_") + what + " is negative");
  if (n > 0) required(arrays, what);
  std::vector<at::Tensor> out;
  out.reserve(std::size_t(n));
  for (int i = 0; i < n; ++i) {
    at::Tensor t = view_of(arrays[i], std::string(what) + "[" + std::to_string(i) + "]");
    // Inputs take the model's dtype: an integer field becomes the model's floats, int32
    // token ids int64 (float token ids stay float: the model refuses them, naming the input).
    // Targets: integers are class labels (int64, as LibTorch's losses take them), floats the
    // model's float dtype.
    const bool integral = !at::isFloatingType(t.scalar_type());
    const bool float_model = at::isFloatingType(want);
    const bool targets = std::string(what) == "targets";
    const at::ScalarType to = !targets      ? (integral || float_model ? want : t.scalar_type())
                              : integral    ? at::kLong
                              : float_model ? want
                                            : t.scalar_type();
    const bool as_is = t.scalar_type() == to && t.is_contiguous() && device.is_cpu();
    out.push_back(as_is ? t
                        : t.to(device, to, /*non_blocking=*/false, /*copy=*/false,
                               at::MemoryFormat::Contiguous));
  }
  return out;
}

// What free and finalize do first, as collective as they are: a save in flight is committed,
// so that nothing saved is lost.
void commit_pending_save(Model& m) {
  if (m.session->save_in_flight()) m.session->wait_save();
}

fs::session::Session& model_of(fullshard_model m) {
  return *live().models.get(m.id, "model")->session;
}

// A checkpoint directory argument: NULL or "" is the configuration's checkpoint.dir.
std::string dir_of(const char* dir) {
  return dir ? std::string(dir) : std::string();
}

// `read_error`: the configuration file could not be read on this rank (the rank still
// joins the agreement, so that every rank reports it).
fullshard_status create_model(fullshard_mesh mesh, const std::string& text,
                              const std::string& source, const std::string& read_error,
                              fullshard_model* model, const char* call) {
  return guarded(call, [&] {
    State& s = live();
    required(model, "model");
    *model = fullshard_model{0};
    std::shared_ptr<fs::DeviceMesh> m = s.meshes.get(mesh.id, "mesh");
    auto session = std::make_unique<fs::session::Session>(
        *m, fs::session::parse_config(*m, text, source, read_error));
    model->id = s.models.add(std::make_shared<Model>(std::move(session)));
  });
}

}  // namespace

// The status of an exception; `plain` is the status of a fullshard::Error of no subclass (a
// file that could not be read or written in the checkpoint calls).
fullshard_status capi::fail_current(const char* call, fullshard_status plain) noexcept {
  auto fail = [&](fullshard_status s, const std::string& message) {
    last_error = std::string(call) + ": " + message;
    if (state && state->rank >= 0 && message.rfind("fullshard[rank", 0) != 0)
      last_error = "fullshard[rank " + std::to_string(state->rank) + "]: " + last_error;
    return s;
  };
  try {
    throw;
  } catch (const NotInitialized& e) {
    return fail(FULLSHARD_ERR_NOT_INITIALIZED, e.message());
  } catch (const capi::HandleError& e) {
    return fail(FULLSHARD_ERR_HANDLE, e.message());
  } catch (const fs::schedule::AutoPlanInfeasible& e) {
    return fail(FULLSHARD_ERR_INFEASIBLE, e.message());
  } catch (const fs::RankMismatch& e) {
    return fail(FULLSHARD_ERR_MISMATCH, e.message());
  } catch (const fs::ConfigError& e) {
    return fail(FULLSHARD_ERR_CONFIG, e.message());
  } catch (const fs::InvalidArgument& e) {
    return fail(FULLSHARD_ERR_ARGUMENT, e.message());
  } catch (const fs::CommError& e) {
    return fail(FULLSHARD_ERR_COMM, e.message());
  } catch (const fs::IoError& e) {
    return fail(FULLSHARD_ERR_IO, e.message());
  } catch (const fs::Error& e) {
    return fail(plain, e.message());
  } catch (const c10::Error& e) {
    // LibTorch refused an argument (a shape the model's layers cannot take).
    return fail(FULLSHARD_ERR_ARGUMENT, std::string("LibTorch: ") + e.what_without_backtrace());
  } catch (const std::bad_alloc&) {
    return fail(FULLSHARD_ERR_INTERNAL, "out of memory");
  } catch (const std::exception& e) {
    return fail(FULLSHARD_ERR_INTERNAL, e.what());
  } catch (...) {
    return fail(FULLSHARD_ERR_INTERNAL, "an unknown exception");
  }
}

void capi::require_initialized() {
  live();
}

extern "C" {

const char* fullshard_last_error(void) {
  return last_error.c_str();
}

const char* fullshard_status_name(int status) {
  switch (status) {
    case FULLSHARD_OK:
      return "FULLSHARD_OK";
    case FULLSHARD_ERR_NOT_INITIALIZED:
      return "FULLSHARD_ERR_NOT_INITIALIZED";
    case FULLSHARD_ERR_HANDLE:
      return "FULLSHARD_ERR_HANDLE";
    case FULLSHARD_ERR_ARGUMENT:
      return "FULLSHARD_ERR_ARGUMENT";
    case FULLSHARD_ERR_CONFIG:
      return "FULLSHARD_ERR_CONFIG";
    case FULLSHARD_ERR_MISMATCH:
      return "FULLSHARD_ERR_MISMATCH";
    case FULLSHARD_ERR_COMM:
      return "FULLSHARD_ERR_COMM";
    case FULLSHARD_ERR_IO:
      return "FULLSHARD_ERR_IO";
    case FULLSHARD_ERR_INFEASIBLE:
      return "FULLSHARD_ERR_INFEASIBLE";
    case FULLSHARD_ERR_INTERNAL:
      return "FULLSHARD_ERR_INTERNAL";
  }
  return "unknown status";
}

fullshard_status fullshard_init(MPI_Comm comm) {
  return guarded("fullshard_init", [&] {
    if (state)
      throw fs::InvalidArgument(
          "fullshard is already initialised (call fullshard_finalize "
          "before initialising it again)");
    int mpi = 0;
    MPI_Initialized(&mpi);
    if (!mpi)
      throw fs::InvalidArgument(
          "MPI is not initialised: call MPI_Init (or MPI_Init_thread) "
          "before fullshard_init");
    if (comm == MPI_COMM_NULL) throw fs::InvalidArgument("comm is MPI_COMM_NULL");
    State s;
    s.runtime = std::make_unique<fs::Runtime>(comm);
    MPI_Comm_rank(comm, &s.rank);
    const int threads = fs::torch::use_launcher_cores(*s.runtime);
    // The simulation's OMP_NUM_THREADS is its choice and stays; otherwise one line says what
    // this process's OpenMP regions now use.
    const char* omp = std::getenv("OMP_NUM_THREADS");
    const char* own = std::getenv("FULLSHARD_TORCH_THREADS");
    if (s.rank == 0 && !(omp && *omp))
      std::fprintf(stderr,
                   "fullshard_init: OMP_NUM_THREADS is not set: using %d thread%s per rank for "
                   "LibTorch and OpenMP (%s; set OMP_NUM_THREADS to choose, fullshard then "
                   "leaves it)\n",
                   threads, threads == 1 ? "" : "s",
                   own && *own ? "FULLSHARD_TORCH_THREADS" : "the cores this rank may use");
    state.emplace(std::move(s));
  });
}

fullshard_status fullshard_init_f(MPI_Fint comm) {
  return fullshard_init(MPI_Comm_f2c(comm));
}

fullshard_status fullshard_finalize(void) {
  return guarded("fullshard_finalize", [&] {
    live();
    // Stores first (they hold only their communicators), then saves and models (they hold
    // meshes), then meshes, then the runtime. A save still in flight is committed first
    // (collective, as finalize is).
    capi::free_stores();
    state->saves.clear();
    for (const std::shared_ptr<Model>& m : state->models.clear())
      commit_pending_save(*m);
    state->meshes.clear();
    state.reset();
  });
}

int fullshard_initialized(void) {
  return state ? 1 : 0;
}

int fullshard_rank(void) {
  return state ? state->rank : -1;
}

fullshard_status fullshard_mesh_create(MPI_Comm comm, const char* device, int ndim,
                                       const int* shape, const char* names, fullshard_mesh* mesh) {
  return guarded("fullshard_mesh_create", [&] {
    required(mesh, "mesh");
    *mesh = fullshard_mesh{0};
    auto m = std::make_shared<fs::DeviceMesh>(make_mesh(comm, device, ndim, shape, names));
    mesh->id = state->meshes.add(std::move(m));
  });
}

fullshard_status fullshard_mesh_create_f(MPI_Fint comm, const char* device, int ndim,
                                         const int* shape, const char* names,
                                         fullshard_mesh* mesh) {
  return fullshard_mesh_create(MPI_Comm_f2c(comm), device, ndim, shape, names, mesh);
}

fullshard_status fullshard_mesh_free(fullshard_mesh* mesh) {
  return guarded("fullshard_mesh_free", [&] {
    State& s = live();
    required(mesh, "mesh");
    if (mesh->id == 0) return;
    s.meshes.remove(mesh->id, "mesh");
    *mesh = fullshard_mesh{0};
  });
}

fullshard_array fullshard_array_contiguous(void* data, fullshard_dtype dtype, int ndim,
                                           const int64_t* shape) {
  fullshard_array a;
  std::memset(&a, 0, sizeof a);
  a.data = data;
  a.dtype = dtype;
  a.ndim = ndim;
  const int n = ndim < 0 ? 0 : (ndim > FULLSHARD_MAX_DIMS ? FULLSHARD_MAX_DIMS : ndim);
  for (int d = 0; d < n && shape; ++d)
    a.shape[d] = shape[d];
  return a;
}

fullshard_status fullshard_model_create(fullshard_mesh mesh, const char* config_path,
                                        fullshard_model* model) {
  if (!config_path || !state)
    return guarded("fullshard_model_create", [&] {
      live();
      throw fs::InvalidArgument("config_path is NULL");
    });
  std::string text, read_error;
  try {
    text = fs::read_text_file(config_path, "configuration");
  } catch (const fs::Error& e) {
    read_error = e.message();
  }
  return create_model(mesh, text, config_path, read_error, model, "fullshard_model_create");
}

fullshard_status fullshard_model_create_from_json(fullshard_mesh mesh, const char* json,
                                                  const char* source, fullshard_model* model) {
  if (!json || !state)
    return guarded("fullshard_model_create_from_json", [&] {
      live();
      throw fs::InvalidArgument("json is NULL");
    });
  return create_model(mesh, json, source ? source : "<string>", "", model,
                      "fullshard_model_create_from_json");
}

fullshard_status fullshard_model_free(fullshard_model* model) {
  return guarded("fullshard_model_free", [&] {
    State& s = live();
    required(model, "model");
    if (model->id == 0) return;
    commit_pending_save(*s.models.get(model->id, "model"));
    s.models.remove(model->id, "model");
    *model = fullshard_model{0};
  });
}

fullshard_status fullshard_train_step(fullshard_model model, int n_inputs,
                                      const fullshard_array* inputs, int n_targets,
                                      const fullshard_array* targets, double* loss) {
  return guarded("fullshard_train_step", [&] {
    fs::session::Session& t = model_of(model);
    const std::vector<at::Tensor> in =
        inputs_of(n_inputs, inputs, t.input_dtype(), t.device(), "inputs");
    const std::vector<at::Tensor> tg =
        inputs_of(n_targets, targets, t.input_dtype(), t.device(), "targets");
    const double l = t.train_step(in, tg);
    if (loss) *loss = l;
  });
}

fullshard_status fullshard_predict(fullshard_model model, int n_inputs,
                                   const fullshard_array* inputs, int n_outputs,
                                   fullshard_array* outputs) {
  return guarded("fullshard_predict", [&] {
    fs::session::Session& t = model_of(model);
    const std::vector<at::Tensor> in =
        inputs_of(n_inputs, inputs, t.input_dtype(), t.device(), "inputs");
    if (n_outputs < 0) throw fs::InvalidArgument("n_outputs is negative");
    if (n_outputs > 0) required(outputs, "outputs");
    std::vector<at::Tensor> dst;
    for (int i = 0; i < n_outputs; ++i)
      dst.push_back(view_of(outputs[i], "outputs[" + std::to_string(i) + "]"));
    const std::vector<at::Tensor> out = t.predict(in);
    if (out.size() != dst.size())
      throw fs::InvalidArgument("the model gives " + std::to_string(out.size()) +
                                " outputs but n_outputs is " + std::to_string(n_outputs));
    for (std::size_t i = 0; i < out.size(); ++i) {
      if (!dst[i].sizes().equals(out[i].sizes()))
        throw fs::InvalidArgument("outputs[" + std::to_string(i) + "] has shape " +
                                  c10::str(dst[i].sizes()) + " but the model's output " +
                                  std::to_string(i) + " has shape " + c10::str(out[i].sizes()));
      dst[i].copy_(out[i]);
    }
  });
}

fullshard_status fullshard_model_step(fullshard_model model, int64_t* step) {
  return guarded("fullshard_model_step", [&] { *required(step, "step") = model_of(model).step(); });
}

fullshard_status fullshard_model_skipped_steps(fullshard_model model, int64_t* count) {
  return guarded("fullshard_model_skipped_steps",
                 [&] { *required(count, "count") = model_of(model).skipped_steps(); });
}

fullshard_status fullshard_model_lr(fullshard_model model, double* lr) {
  return guarded("fullshard_model_lr", [&] { *required(lr, "lr") = model_of(model).lr(); });
}

fullshard_status fullshard_model_num_params(fullshard_model model, int64_t* count) {
  return guarded("fullshard_model_num_params",
                 [&] { *required(count, "count") = model_of(model).num_params(); });
}

fullshard_status fullshard_model_plan(fullshard_model model, fullshard_plan_info* info) {
  return guarded("fullshard_model_plan", [&] {
    const fs::session::PlanPrediction& p = model_of(model).plan();
    fullshard_plan_info* out = required(info, "info");
    out->step_ms = p.step_ms;
    out->peak_bytes = p.peak_bytes;
    out->sharded_bytes = p.sharded_bytes;
    out->groups = p.groups;
    out->process_peak_bytes = p.process_peak_bytes;
    out->calibrated_iterations = p.calibrated_iterations;
    out->optimizer_ms = p.optimizer_ms;
    out->communication_scale = p.communication_scale;
  });
}

fullshard_status fullshard_model_memory(fullshard_model model, fullshard_memory_parts* planned,
                                        fullshard_memory_parts* measured) {
  return guarded("fullshard_model_memory", [&] {
    const fs::session::Session& session = model_of(model);
    fullshard_memory_parts* out = required(planned, "planned");
    *out = fullshard_memory_parts{};
    if (measured) *measured = fullshard_memory_parts{};
    if (session.mesh().device_type() != fs::DeviceType::cpu) return;
    const fs::schedule::MemoryAccount& p = session.planned_memory();
    auto fill = [](fullshard_memory_parts& o, const fs::schedule::MemoryAccount& a) {
      o.baseline = std::int64_t(a.baseline);
      o.shards = std::int64_t(a.shards);
      o.gradients = std::int64_t(a.gradients);
      o.optimizer_state = std::int64_t(a.optimizer_state);
      o.pool = std::int64_t(a.pool);
      o.windows = std::int64_t(a.windows);
      o.activations = std::int64_t(a.activations);
      o.untracked = std::int64_t(a.untracked);
    };
    fill(*out, p);
    out->process_peak = std::int64_t(p.process_peak());
    if (!measured) return;
    fs::schedule::MemoryAccount m =
        fs::schedule::measured_memory(fs::memory_ledger::counts(), fs::schedule::Counted::now);
    m.baseline = p.baseline;
    m.activations = p.activations;
    m.untracked = p.untracked;
    fill(*measured, m);
    measured->process_peak = std::int64_t(fs::schedule::process_peak_share(
        fs::schedule::process_memory(), fs::schedule::own_window_bytes(session.mesh())));
  });
}

fullshard_status fullshard_checkpoint_save(fullshard_model model, const char* dir) {
  return guarded(
      "fullshard_checkpoint_save", [&] { model_of(model).save(dir_of(dir)); }, FULLSHARD_ERR_IO);
}

fullshard_status fullshard_checkpoint_save_async(fullshard_model model, const char* dir,
                                                 fullshard_save* save) {
  return guarded(
      "fullshard_checkpoint_save_async",
      [&] {
        State& s = live();
        required(save, "save");
        *save = fullshard_save{0};
        const std::shared_ptr<Model> m = s.models.get(model.id, "model");
        m->session->save_async(dir_of(dir));
        auto handle = std::make_shared<Save>();
        handle->model = m;
        handle->serial = ++m->async_saves;
        save->id = s.saves.add(std::move(handle));
      },
      FULLSHARD_ERR_IO);
}

fullshard_status fullshard_save_test(fullshard_save* save, int* done) {
  return guarded(
      "fullshard_save_test",
      [&] {
        State& s = live();
        required(save, "save");
        required(done, "done");
        const std::shared_ptr<Save> h = s.saves.get(save->id, "save");
        *done = 0;
        if (h->in_flight() && !h->model->session->poll_save()) return;
        s.saves.remove(save->id, "save");
        *save = fullshard_save{0};
        *done = 1;
      },
      FULLSHARD_ERR_IO);
}

fullshard_status fullshard_save_wait(fullshard_save* save) {
  return guarded(
      "fullshard_save_wait",
      [&] {
        State& s = live();
        required(save, "save");
        const std::shared_ptr<Save> h = s.saves.get(save->id, "save");
        s.saves.remove(save->id, "save");
        *save = fullshard_save{0};
        if (h->in_flight()) h->model->session->wait_save();
      },
      FULLSHARD_ERR_IO);
}

fullshard_status fullshard_checkpoint_load(fullshard_model model, const char* dir) {
  return guarded(
      "fullshard_checkpoint_load", [&] { model_of(model).load(dir_of(dir)); }, FULLSHARD_ERR_IO);
}

fullshard_status fullshard_export_safetensors(fullshard_model model, const char* path) {
  return guarded(
      "fullshard_export_safetensors",
      [&] { model_of(model).export_safetensors(required(path, "path")); }, FULLSHARD_ERR_IO);
}

/// Not in fullshard.h (the Fortran module's C part): records a failed call's message.
fullshard_status fullshard_detail_fail(fullshard_status status, const char* message) {
  last_error = message ? message : "";
  if (state && state->rank >= 0)
    last_error = "fullshard[rank " + std::to_string(state->rank) + "]: " + last_error;
  return status;
}

/// Not in fullshard.h (tests of the status mapping): fails with the exception a run-time
/// failure of that kind throws: 0 an MPI/NCCL failure (CommError), 1 a fullshard bug (any
/// other exception).
fullshard_status fullshard_detail_raise(int kind) {
  return guarded("fullshard_detail_raise", [&] {
    if (kind == 0) throw fs::CommError("MPI_Iallreduce failed (raised by a test)");
    throw std::logic_error("an internal error (raised by a test)");
  });
}

/// Not in fullshard.h (tests): the data pointer of the first input of the model's last
/// forward, to check that a contiguous array of the model's dtype reaches it without a copy.
fullshard_status fullshard_detail_last_input(fullshard_model model, const void** data) {
  return guarded("fullshard_detail_last_input",
                 [&] { *required(data, "data") = model_of(model).last_input_data(); });
}

}  // extern "C"
