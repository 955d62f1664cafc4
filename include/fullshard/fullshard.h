/* fullshard.h: the C API of fullshard (C99; C++ may include it too). A model described by a
 * JSON configuration file (docs/guide/c-fortran.md) is built by fullshard's training
 * session (C++: fullshard/session/session.hpp, which these calls adapt), sharded over the ranks
 * of the simulation's own MPI communicator (FSDP2's fully_shard), and trained on the
 * simulation's arrays. Link the CMake target fullshard::c
 * (find_package(fullshard COMPONENTS C)); Fortran: the module `fullshard`
 * (COMPONENTS Fortran), which wraps these calls.
 *
 *   fullshard_init(MPI_COMM_WORLD);                       after MPI_Init, collective
 *   fullshard_mesh mesh;  int shape[1] = {nranks};
 *   fullshard_mesh_create(comm, "cpu", 1, shape, "dp", &mesh);
 *   fullshard_model model;
 *   fullshard_model_create(mesh, "model.json", &model);  collective
 *   fullshard_array x = fullshard_array_contiguous(xs, FULLSHARD_FLOAT32, 2, x_shape);
 *   fullshard_array y = fullshard_array_contiguous(ys, FULLSHARD_FLOAT32, 2, y_shape);
 *   double loss;
 *   fullshard_train_step(model, 1, &x, 1, &y, &loss);    collective, each rank its batch
 *   fullshard_model_free(&model); fullshard_mesh_free(&mesh); fullshard_finalize();
 *
 * The in-situ sample store (fullshard_store_create, below) carries samples from the
 * simulation's ranks to the training ranks' bounded buffers and draws mixed batches.
 *
 * Errors. Every call returns a fullshard_status; FULLSHARD_OK is 0. After any other status,
 * fullshard_last_error() is a message naming what was wrong (the call, the rank, the
 * handle, argument, configuration key and file). No C++ exception crosses this boundary. A
 * collective that a peer never joins is not an error status: after FULLSHARD_TIMEOUT seconds
 * (default 600) the job is aborted with a message naming the rank and the operation, as
 * everywhere in fullshard, so that no rank waits forever.
 *
 * Collective calls (marked "Collective") must be made by every rank of the mesh's (or
 * init's) communicator, in the same order, with the same configuration.
 *
 * Handles are values: a mesh, model or store handle holds an id and a generation count, so a
 * freed handle, a handle of another kind, or one never returned by fullshard is an error
 * (FULLSHARD_ERR_HANDLE), not a crash. The zero handle ({0}) is the null handle.
 *
 * Threads. fullshard makes every MPI call from the thread that calls it, so the simulation
 * may initialise MPI with any thread level (MPI_Init included); a level below
 * MPI_THREAD_MULTIPLE is reported in one line by fullshard_init (FULLSHARD_HOST_PROGRESS=
 * thread is then refused). Call fullshard from one thread at a time. LibTorch's intra-op
 * threads default to the cores this rank may use (its affinity mask, or the node's cores
 * divided by its ranks; FULLSHARD_TORCH_THREADS or the configuration's "threads" overrides)
 * unless OMP_NUM_THREADS is set, which fullshard then leaves as it is: since LibTorch sets its
 * count through OpenMP, the simulation's OpenMP regions on the same thread use that count too
 * (fullshard_init says so in one line on rank 0), and the two take turns on the same cores. */
#ifndef FULLSHARD_H
#define FULLSHARD_H

#include <mpi.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Status ---------------------------------------------------------------------------- */

typedef enum fullshard_status {
  FULLSHARD_OK = 0,
  /** A call before fullshard_init or after fullshard_finalize. */
  FULLSHARD_ERR_NOT_INITIALIZED = 1,
  /** A null handle, a freed one, one of another kind or one fullshard never returned. */
  FULLSHARD_ERR_HANDLE = 2,
  /** A bad argument: a null pointer, a shape or dtype the model does not take, a name. */
  FULLSHARD_ERR_ARGUMENT = 3,
  /** The configuration file or a setting: an unknown key, a wrong type, a bad value. */
  FULLSHARD_ERR_CONFIG = 4,
  /** The ranks of one communicator disagree (mesh, configuration, model). */
  FULLSHARD_ERR_MISMATCH = 5,
  /** An MPI or NCCL call failed. */
  FULLSHARD_ERR_COMM = 6,
  /** A file could not be read or written (checkpoint, safetensors, TorchScript). */
  FULLSHARD_ERR_IO = 7,
  /** The auto-planner found no sharding under the configuration's memory budget. */
  FULLSHARD_ERR_INFEASIBLE = 8,
  /** Anything else (a bug of fullshard's: please report it with the message). */
  FULLSHARD_ERR_INTERNAL = 9
} fullshard_status;

/** The message of the last call that did not return FULLSHARD_OK on this thread ("" when
 * none did). Valid until the next failing call on this thread. */
const char* fullshard_last_error(void);
/** "FULLSHARD_OK", "FULLSHARD_ERR_HANDLE", ... ("unknown status" otherwise). */
const char* fullshard_status_name(int status);

/* ---- The runtime ----------------------------------------------------------------------- */

/** Starts fullshard in this process; `comm` is the simulation's communicator of the ranks
 * that use fullshard (all ranks, or the training ranks only; meshes are made over it or a
 * sub-communicator, duplicated): rank placement and GPU binding are among its ranks. MPI
 * must be initialised; fullshard never finalises it.
 * Starts Kokkos when the simulation has not. Reads the FULLSHARD_* variables
 * (FULLSHARD_ERR_CONFIG naming a bad one). A second call before fullshard_finalize is
 * FULLSHARD_ERR_ARGUMENT. Collective over comm. */
fullshard_status fullshard_init(MPI_Comm comm);
/** The same with a Fortran communicator handle (MPI_Comm_f2c). */
fullshard_status fullshard_init_f(MPI_Fint comm);
/** Frees every sample store, mesh and model still alive (a store as fullshard_store_free does,
 * without its close) and stops what fullshard_init started (Kokkos, when fullshard started
 * it). Collective over init's communicator. After it, calls return
 * FULLSHARD_ERR_NOT_INITIALIZED until the next fullshard_init (Kokkos cannot start twice in
 * one process: a second init after finalize works only when the simulation owns Kokkos). */
fullshard_status fullshard_finalize(void);
/** 1 between fullshard_init and fullshard_finalize, else 0. */
int fullshard_initialized(void);
/** This rank in init's communicator (-1 before init). */
int fullshard_rank(void);

/* ---- Meshes ---------------------------------------------------------------------------- */

typedef struct fullshard_mesh {
  uint64_t id;
} fullshard_mesh;

/** A device mesh over the ranks of `comm` (all of them, or a sub-communicator of init's):
 * `ndim` dims (1 or 2) of `shape[i]` ranks, product = the ranks of comm; `names` the dim
 * names separated by commas ("dp", or "replicate,shard": a 2-D mesh is HSDP, replicated over
 * its first dim and sharded over its last). `device` is "cpu" or "cuda". Collective over comm;
 * the ranks must agree (FULLSHARD_ERR_MISMATCH naming the rank that differs). */
fullshard_status fullshard_mesh_create(MPI_Comm comm, const char* device, int ndim,
                                       const int* shape, const char* names, fullshard_mesh* mesh);
fullshard_status fullshard_mesh_create_f(MPI_Fint comm, const char* device, int ndim,
                                         const int* shape, const char* names, fullshard_mesh* mesh);
/** Frees the mesh (models made on it keep their own reference) and sets *mesh to {0}.
 * Freeing the null handle is FULLSHARD_OK. Not collective. */
fullshard_status fullshard_mesh_free(fullshard_mesh* mesh);

/* ---- Arrays ---------------------------------------------------------------------------- */

typedef enum fullshard_dtype {
  FULLSHARD_FLOAT32 = 0,
  FULLSHARD_FLOAT64 = 1,
  FULLSHARD_INT32 = 2,
  FULLSHARD_INT64 = 3
} fullshard_dtype;

#define FULLSHARD_MAX_DIMS 8

/** A view of the caller's memory, in C (row-major) order: shape[0] is the slowest dim and,
 * for inputs and targets, the batch (samples) dim. strides[i] are in elements; when all
 * ndim of them are 0 the array is contiguous. fullshard reads it (inputs, targets) or writes
 * it (outputs) during the call only, and keeps no pointer. Fortran's column-major arrays are
 * these with the dims reversed (the Fortran module does it: x(features, samples) is the
 * (samples, features) tensor). */
typedef struct fullshard_array {
  void* data;
  int32_t dtype; /* fullshard_dtype */
  int32_t ndim;  /* 1 .. FULLSHARD_MAX_DIMS */
  int64_t shape[FULLSHARD_MAX_DIMS];
  int64_t strides[FULLSHARD_MAX_DIMS];
} fullshard_array;

/** A contiguous C-order array over `data` (ndim is clamped to 0 .. FULLSHARD_MAX_DIMS; a bad
 * value is reported by the call that uses the array). */
fullshard_array fullshard_array_contiguous(void* data, fullshard_dtype dtype, int ndim,
                                           const int64_t* shape);

/* ---- Models ---------------------------------------------------------------------------- */

typedef struct fullshard_model {
  uint64_t id;
} fullshard_model;

/** Builds, shards and initialises the model that the JSON configuration file at
 * `config_path` describes (docs/guide/c-fortran.md, "The configuration file"), on `mesh`. The same
 * seed gives the same initial parameters on any mesh. Errors name the file and the key. Collective
 * over the mesh; every rank must read the same configuration (FULLSHARD_ERR_MISMATCH naming the
 * first key that differs and the rank). */
fullshard_status fullshard_model_create(fullshard_mesh mesh, const char* config_path,
                                        fullshard_model* model);
/** The same from the configuration's text (`source` names it in messages; NULL: "<string>"). */
fullshard_status fullshard_model_create_from_json(fullshard_mesh mesh, const char* json,
                                                  const char* source, fullshard_model* model);
/** Frees the model and sets *model to {0}; the null handle is FULLSHARD_OK. An asynchronous
 * save still in flight is committed first. Collective over the model's mesh. */
fullshard_status fullshard_model_free(fullshard_model* model);

/** One optimizer step: forward of this rank's batch (`inputs`, n_inputs of them, the model's
 * forward arguments in order), the configuration's loss against `targets` (summed over the
 * outputs when there are several; the "next_token" loss of a GPT takes no target), backward
 * (the gradients reduce-scattered over the mesh: the mean over the data-parallel ranks),
 * gradient clipping, the optimizer and the learning-rate schedule. `*loss` (may be NULL):
 * this rank's loss (reduce it over the ranks yourself when you need the mean). An input of
 * the model's dtype that is contiguous reaches the model without a copy; other inputs are
 * converted or gathered once. Every rank's batch must have the same shapes except the batch
 * dim, and the same dtypes: a batch that differs on some ranks is refused on every rank
 * (FULLSHARD_ERR_ARGUMENT naming the ranks and their shapes) before any other collective.
 * With "accumulation": k in the configuration, the batch is split along its first dim into k
 * micro-batches (sizes differing by at most one) whose gradients are summed before one
 * reduce-scatter: the step the whole batch gives, in 1/k of the activation memory.
 * Collective over the mesh. */
fullshard_status fullshard_train_step(fullshard_model model, int n_inputs,
                                      const fullshard_array* inputs, int n_targets,
                                      const fullshard_array* targets, double* loss);
/** Inference on this rank's batch, without gradients: writes the model's outputs into
 * `outputs` (n_outputs of them, shapes as the model gives them; any dtype of the four, cast
 * on the way). Collective over the mesh. */
fullshard_status fullshard_predict(fullshard_model model, int n_inputs,
                                   const fullshard_array* inputs, int n_outputs,
                                   fullshard_array* outputs);

/** Optimizer steps taken so far (restored by fullshard_checkpoint_load). */
fullshard_status fullshard_model_step(fullshard_model model, int64_t* step);
/** Steps skipped for a non-finite value: a NaN or infinity in an input or target array, the
 * loss or the gradients skips the step on every rank (fullshard_train_step returns
 * FULLSHARD_OK with loss NaN; the step count stays) or, with "non_finite": {"policy":
 * "stop"} (or past "max_skipped"), FULLSHARD_ERR_ARGUMENT on every rank naming the step, the
 * rank and the array ("input 0 holds nan at [3, 2]"). */
fullshard_status fullshard_model_skipped_steps(fullshard_model model, int64_t* count);
/** The learning rate of the next step. */
fullshard_status fullshard_model_lr(fullshard_model model, double* lr);
/** The number of parameters of the whole (unsharded) model. */
fullshard_status fullshard_model_num_params(fullshard_model model, int64_t* count);

/** What the planner predicts for one training step (one forward and backward) on this mesh.
 * At creation the modules' compute costs are not known: step_ms is the communication and
 * copies, a lower bound. After the calibration steps ("sharding": {"calibrate_steps"}, 10 by
 * default, after the first step; CPU meshes, without accumulation) the modules' measured
 * compute times and the optimizer's are in it (calibrated_iterations > 0). The memory is
 * exact. */
typedef struct fullshard_plan_info {
  double step_ms;        /* predicted step time (the plan's cost model) */
  int64_t peak_bytes;    /* predicted peak of fullshard's buffer pool per rank */
  int64_t sharded_bytes; /* this rank's sharded parameters */
  int64_t groups;        /* communication groups (fully_shard calls) */
  /* planned peak of this rank's process (docs/memory.md): shards, gradients, optimizer state,
   * pool, shared-memory windows and the process's resident memory at creation; from the
   * first train step on also LibTorch's activations, from the second the untracked part, as
   * the steps measured them. 0 on a CUDA mesh (the account is of host memory). */
  int64_t process_peak_bytes;
  /* 0: default module costs; n: the modules' costs measured over n forwards and backwards */
  int64_t calibrated_iterations;
  double optimizer_ms; /* the optimizer's measured step, in step_ms once calibrated */
  /* the calibration steps' collectives as they ran over the cost model's times (1 before) */
  double communication_scale;
} fullshard_plan_info;
fullshard_status fullshard_model_plan(fullshard_model model, fullshard_plan_info* info);

/** This rank's memory by part, in bytes (docs/memory.md, "The account"). */
typedef struct fullshard_memory_parts {
  int64_t baseline;        /* the process before the model (resident at creation) */
  int64_t shards;          /* the sharded parameters */
  int64_t gradients;       /* the sharded gradients */
  int64_t optimizer_state; /* momentum, AdamW's moments */
  int64_t pool;            /* unsharded parameters and gradients in flight (the buffer pool) */
  int64_t windows;         /* shared-memory window segments besides the shards */
  int64_t activations;     /* LibTorch's, measured by the first train step (0 before) */
  int64_t untracked;       /* beyond every part at a step's peak (measured from step 2) */
  int64_t process_peak;    /* planned: the sum; measured: the process's share at its peak */
} fullshard_memory_parts;
/** `planned`: the plan's account, as the memory check and fullshard_model_plan's
 * process_peak_bytes hold it. `measured` (may be NULL): the library's parts as its ledger
 * holds them now (every model of the process; a model's parts stay allocated between steps),
 * the activations and the untracked part as measured (the planned values), and the process's
 * peak resident memory (VmHWM) less the
 * shared-memory pages of the peers' windows it maps: what to compare with a budget. All zero
 * on a CUDA mesh (the account is of host memory). */
fullshard_status fullshard_model_memory(fullshard_model model, fullshard_memory_parts* planned,
                                        fullshard_memory_parts* measured);

/* Checkpoints. `dir` is a checkpoint root; NULL (or "") is the configuration's
 * "checkpoint": {"dir"}, which is checked at fullshard_model_create (created if its parent
 * exists, written by every rank, and shared by them: a node-local directory on a cluster is
 * refused there, naming the path and the rank). A checkpoint holds the parameters, the
 * optimizer state, the step count and the model's and optimizer's identity; it loads on any
 * number of ranks. "keep_last": n keeps the n most recent step directories. */

/** Saves as a new step directory under `dir` (waiting first for an asynchronous save in
 * flight). Collective. */
fullshard_status fullshard_checkpoint_save(fullshard_model model, const char* dir);

/** An asynchronous save in flight (0: none). */
typedef struct fullshard_save {
  uint64_t id;
} fullshard_save;

/** Starts saving in the background: returns once this rank's parameters and optimizer state
 * are copied into host memory, so training goes on while a thread writes the files; then
 * fullshard_save_test at step boundaries, or fullshard_save_wait, commits the checkpoint.
 * One save per model at a time: starting another while one is in flight is
 * FULLSHARD_ERR_ARGUMENT naming it (fullshard_checkpoint_save, load and model_free wait for it
 * themselves). Collective. */
fullshard_status fullshard_checkpoint_save_async(fullshard_model model, const char* dir,
                                                 fullshard_save* save);
/** Commits the save when every rank's files are written: *done = 1 and *save = {0} (the handle
 * is finished); *done = 0 while they are being written. A failed write is reported on every
 * rank (FULLSHARD_ERR_IO naming the rank and the file; the previous checkpoint stays the
 * latest). Collective (one small all-reduce). */
fullshard_status fullshard_save_test(fullshard_save* save, int* done);
/** Waits for the save and commits it; sets *save to {0}. A finished or freed handle (after
 * test reported done, or a second wait) is FULLSHARD_ERR_HANDLE. Collective. */
fullshard_status fullshard_save_wait(fullshard_save* save);

/** Loads the latest checkpoint under `dir` (saved on any number of ranks) into the model and
 * its optimizer, and restores the step count. A checkpoint of another model or optimizer is
 * refused on every rank (FULLSHARD_ERR_ARGUMENT naming the first difference) before anything
 * changes; a directory that does not exist or holds no checkpoint, or a file of it that cannot
 * be read, is FULLSHARD_ERR_IO naming it. Collective. */
fullshard_status fullshard_checkpoint_load(fullshard_model model, const char* dir);
/** Writes the full (unsharded) parameters as one safetensors file at `path` (rank 0 writes;
 * PyTorch's safetensors.torch.load_file reads it). Collective. */
fullshard_status fullshard_export_safetensors(fullshard_model model, const char* path);

/* ---- The in-situ sample store ---------------------------------------------------------- */

/* Producer ranks (the simulation) put samples from their own arrays; consumer ranks (the
 * training: the same ranks or others of the same communicator) draw mini-batches mixed
 * across the producers, each from a buffer of bounded memory (C++:
 * fullshard/store/sample_store.hpp, which these calls adapt; guide: docs/guide/in-situ.md,
 * "The sample store"). Shapes are in C order (Fortran: the module reverses them). Every wait
 * of a put, draw or close is bounded by the store's timeout and ends in FULLSHARD_ERR_COMM
 * naming the store, the rank and the peer waited for (a wait that only this rank's own puts or
 * draws could end is FULLSHARD_ERR_ARGUMENT at once, saying so); the collectives of create and
 * global_moments abort the job at the timeout, as fullshard's other collectives do.
 *
 *   fullshard_store_field f[2] = {{"x", FULLSHARD_FLOAT32, 1, {3}}, {"y", FULLSHARD_FLOAT32, 0}};
 *   fullshard_store_options o = fullshard_store_options_default();  reservoir, nonblocking,
 *   o.n_fields = 2; o.fields = f;                                    min_samples 1
 *   fullshard_store store;
 *   fullshard_store_create(MPI_COMM_WORLD, FULLSHARD_STORE_BOTH, &o, &store);  collective
 *   float xb[32][3], yb[32];
 *   void* batch[2] = {xb, yb};
 *   int64_t n;
 *   for (int64_t step = 0; step < steps; ++step) {
 *     simulate(step);                                 x[cell][3], y[cell]
 *     for (int64_t k = 0; k < nsampled; ++k) {        every sampled cell of the step
 *       const int64_t cell = sampled[k];
 *       const void* sample[2] = {x[cell], &y[cell]};
 *       fullshard_store_put(store, step, cell, sample, NULL, NULL);
 *     }
 *     fullshard_store_draw(store, 32, batch, NULL, NULL, NULL, &n);  then train on xb, yb
 *   }
 *   fullshard_store_end_of_stream(store);
 *   do fullshard_store_draw(store, 32, batch, NULL, NULL, NULL, &n); while (n > 0);  the rest
 *   fullshard_store_close(store); fullshard_store_free(&store);                collective
 *
 * A reservoir or window draw waits only until the buffer holds min_samples samples (1) and
 * draws with replacement from them (the trainer replays when the simulation is slower); a FIFO
 * draw waits for its whole batch. */

/** A sample store (0: none). A value as the mesh and model handles are: a freed handle is
 * FULLSHARD_ERR_HANDLE. */
typedef struct fullshard_store {
  uint64_t id;
} fullshard_store;

/** What this rank does in the store. */
typedef enum fullshard_store_role {
  FULLSHARD_STORE_PRODUCER = 0, /**< puts samples */
  FULLSHARD_STORE_CONSUMER = 1, /**< draws batches */
  FULLSHARD_STORE_BOTH = 2      /**< both (a rank that simulates and trains in turn) */
} fullshard_store_role;

/** Which samples a consumer's buffer keeps and how a draw picks them. */
typedef enum fullshard_store_policy {
  /** Vitter's algorithm R: a uniform sample of `capacity` of every sample this consumer
   * ingested; a draw picks uniformly, with replacement (the default). */
  FULLSHARD_STORE_RESERVOIR = 0,
  /** A bounded queue: a draw takes the oldest samples, each once; an arrival into a full
   * buffer pushes the oldest out (evicted). */
  FULLSHARD_STORE_FIFO = 1,
  /** The last `window` samples ingested; a draw picks uniformly, with replacement. */
  FULLSHARD_STORE_WINDOW = 2
} fullshard_store_policy;

/** How samples travel from producers to consumers. */
typedef enum fullshard_store_delivery {
  /** A put never waits: a sample whose consumer has `in_flight` samples unacknowledged is
   * dropped (counted); consumers ingest what has arrived, in any order (the default). */
  FULLSHARD_STORE_NONBLOCKING = 0,
  /** No sample is lost in transit and a run is reproducible for a seed at the same rank
   * counts: a put waits for credit; a consumer ingests in a fixed order `ingest_per_draw`
   * samples before each draw (the producers must together put at least as many as the
   * consumers ingest). The policy may still evict what arrived (FIFO or window with more
   * ingested than drawn, e.g. ingest_per_draw > batch; the reservoir's rejections), and close
   * discards what was never ingested (discarded_at_close). After every producer's end of
   * stream, draws drain the buffer from the first draw whose ingestion comes up short (every
   * end marker was waited for): the batches do not depend on timing. */
  FULLSHARD_STORE_LOSSLESS = 1
} fullshard_store_delivery;

/** What a put does with a NaN or an infinity in a sample. */
typedef enum fullshard_store_non_finite {
  /** FULLSHARD_ERR_ARGUMENT naming the store, field, element, step and rank (the default). */
  FULLSHARD_STORE_REFUSE = 0,
  /** The sample is not sent (*sent = 0), counted as dropped and non-finite. */
  FULLSHARD_STORE_DROP = 1
} fullshard_store_non_finite;

/** One array of every sample. */
typedef struct fullshard_store_field {
  /** The field's name (copied by fullshard_store_create; unique, not empty). */
  const char* name;
  /** FULLSHARD_FLOAT32 or FULLSHARD_FLOAT64 (a fullshard_dtype; the store keeps no integers). */
  int32_t dtype;
  /** Dims of one sample: 0 (a scalar) to FULLSHARD_MAX_DIMS. */
  int32_t ndim;
  /** One sample's shape in C (row-major) order, no batch dim; every extent >= 1. */
  int64_t shape[FULLSHARD_MAX_DIMS];
  /** Nonzero: an f64 field kept (sent, buffered, drawn) as f32; puts take f64 (rounded to
   * nearest) or f32, draws give f32. Only for dtype FULLSHARD_FLOAT64. */
  int32_t store_as_f32;
  /** Nonzero: elements must be 0 or 1 (checked at put); such a field has no moments. */
  int32_t mask;
} fullshard_store_field;

/** The store's configuration; every rank of the communicator passes the same (compared:
 * FULLSHARD_ERR_MISMATCH naming the first difference and the rank; bad options on any rank are
 * FULLSHARD_ERR_ARGUMENT on every rank first). Start from fullshard_store_options_default(). */
typedef struct fullshard_store_options {
  /** The fields of a sample (n_fields >= 1 of them), in the order put and draw take them. */
  const fullshard_store_field* fields;
  int32_t n_fields;
  int32_t policy;     /**< fullshard_store_policy (FULLSHARD_STORE_RESERVOIR) */
  int32_t delivery;   /**< fullshard_store_delivery (FULLSHARD_STORE_NONBLOCKING) */
  int32_t non_finite; /**< fullshard_store_non_finite (FULLSHARD_STORE_REFUSE) */
  /** Samples each consumer's buffer holds, >= 1: its memory bound (capacity x sample bytes)
   * (1024). */
  int64_t capacity;
  /** FULLSHARD_STORE_WINDOW: the last `window` samples, 0 (the capacity) to capacity (0). */
  int64_t window;
  /** Samples a producer may have in transit to one consumer (unacknowledged), >= 1 (4). */
  int64_t in_flight;
  /** FULLSHARD_STORE_LOSSLESS: samples a consumer ingests before each draw (0: the batch). */
  int64_t ingest_per_draw;
  /** FULLSHARD_STORE_RESERVOIR and _WINDOW: a draw waits until the buffer holds this many
   * samples, 1 to the bound (capacity, or the window), then draws its batch with replacement
   * from them; a FIFO draw waits for its whole batch (checked, not used) (1). */
  int64_t min_samples;
  /** Seeds the consumers' random choices (each consumer its own stream) (0). */
  uint64_t seed;
  /** Bound on every wait, seconds (0: FULLSHARD_TIMEOUT, default 600). */
  double timeout_s;
  /** The store's name in messages (NULL: "store"). */
  const char* name;
} fullshard_store_options;

/** The defaults: no fields, reservoir, nonblocking, capacity 1024, window 0, in_flight 4,
 * ingest_per_draw 0, min_samples 1, seed 0, non-finite values refused, timeout 0
 * (FULLSHARD_TIMEOUT), name NULL ("store"). */
fullshard_store_options fullshard_store_options_default(void);

/** Creates a sample store over the ranks of `comm` (duplicated: the store's messages never
 * meet the simulation's), this rank in `role`. Collective over comm. Each rank checks its own
 * options first: bad options on any rank (NULL options, an empty or repeated field name, ndim
 * above FULLSHARD_MAX_DIMS, an extent < 1, a dtype other than FULLSHARD_FLOAT32 or
 * FULLSHARD_FLOAT64, store_as_f32 on a float32 field, an unknown policy, capacity < 1, ...) are
 * FULLSHARD_ERR_ARGUMENT on every rank, carrying the first bad rank's problem ("bad options on
 * rank r: ..."), so that no rank is left waiting. Then the ranks compare their options
 * (FULLSHARD_ERR_MISMATCH naming the first difference and the rank) and exchange roles; there
 * must be at least one producer and one consumer. Needs fullshard_init. */
fullshard_status fullshard_store_create(MPI_Comm comm, fullshard_store_role role,
                                        const fullshard_store_options* options,
                                        fullshard_store* store);
/** The same with a Fortran communicator handle (MPI_Comm_f2c). */
fullshard_status fullshard_store_create_f(MPI_Fint comm, fullshard_store_role role,
                                          const fullshard_store_options* options,
                                          fullshard_store* store);

/** Producer: one sample. `data[f]` is field f's array (in the order of the options' fields),
 * of the field's shape and dtype (FULLSHARD_FLOAT64 for a store_as_f32 field; use
 * fullshard_store_put_arrays to pass float32 there). `strides` (may be NULL: every field
 * contiguous in C order) holds per field NULL (contiguous) or the field's ndim strides in
 * elements (>= 1). `step`: the producer's simulation step; `tag`: the caller's position or id
 * of the sample (both come back with a draw's metadata). Nonblocking delivery never waits: a
 * sample whose consumer has `in_flight` samples unacknowledged is dropped before its values
 * are read (not checked, not counted as non-finite); lossless delivery waits for credit before
 * the checks (FULLSHARD_ERR_COMM naming the consumer rank at the timeout; a put whose credit
 * only this rank's own draws could give is FULLSHARD_ERR_ARGUMENT at once). A consumer in
 * fullshard_store_close keeps acknowledging (discarding what arrives), so such a put ends. `*sent`
 * (may be NULL): 1 when the sample was sent, 0 when it was dropped. A NaN or infinity: refused
 * (FULLSHARD_ERR_ARGUMENT naming the field, element, step and rank) or dropped, as the options
 * say; a mask element other than 0 or 1 is refused. Not collective. */
fullshard_status fullshard_store_put(fullshard_store store, int64_t step, int64_t tag,
                                     const void* const* data, const int64_t* const* strides,
                                     int* sent);
/** Producer: the same with one fullshard_array per field (n_fields of them, in the options'
 * order), whose shape and dtype are checked against the field's (FULLSHARD_ERR_ARGUMENT naming
 * the field, the expected and the given): any strides (all 0: contiguous), and float32 or
 * float64 for a store_as_f32 field. The Fortran module's put. Not collective. */
fullshard_status fullshard_store_put_arrays(fullshard_store store, int64_t step, int64_t tag,
                                            int n_fields, const fullshard_array* fields, int* sent);
/** Producer: no more puts from this rank; every consumer learns it. A second call does
 * nothing. Not collective. */
fullshard_status fullshard_store_end_of_stream(fullshard_store store);

/** Consumer: `batch` samples. `out[f]` receives field f's batch, contiguous in C order:
 * batch x the field's shape, in its stored dtype (float32 for a store_as_f32 field). `steps`,
 * `ranks`, `tags` (each may be NULL; else `batch` elements): each drawn sample's step, producer
 * rank (in the store's communicator) and tag, as put. A reservoir or window draw waits until
 * the buffer holds min_samples samples and draws `batch` with replacement from them; a FIFO
 * draw waits for its whole batch. Nonblocking: it waits (up to the timeout) until the buffer
 * holds that many; lossless: it ingests `ingest_per_draw` samples in order, then more until it
 * does. A wait that only this rank's own later puts could end (one rank; the other producers
 * ended; lossless, the next sample in order is this rank's own) is FULLSHARD_ERR_ARGUMENT at
 * once, saying so. Once every producer ended and everything was ingested (lossless: from the
 * first draw whose ingestion comes up short), draws drain the buffer without replacement.
 * `*drawn`: `batch`, or fewer only once the stream ended (0: nothing is left); rows past it are
 * left as they were. Not collective. */
fullshard_status fullshard_store_draw(fullshard_store store, int64_t batch, void* const* out,
                                      int64_t* steps, int* ranks, int64_t* tags, int64_t* drawn);
/** Consumer: the same into one fullshard_array per field (n_fields of them), each of shape
 * (batch, the field's shape...) and the field's stored dtype, checked (FULLSHARD_ERR_ARGUMENT
 * naming the field, the expected and the given); any strides (all 0: contiguous). The Fortran
 * module's draw. Not collective. */
fullshard_status fullshard_store_draw_arrays(fullshard_store store, int64_t batch, int n_fields,
                                             const fullshard_array* out, int64_t* steps, int* ranks,
                                             int64_t* tags, int64_t* drawn);

/** `*ended` = 1 once this consumer has every producer's end of stream and ingested everything
 * they sent (its buffer may still hold samples to draw); on a rank that is only a producer,
 * once its fullshard_store_end_of_stream was called. Else 0. Not collective. */
fullshard_status fullshard_store_ended(fullshard_store store, int* ended);
/** Receives what has arrived without waiting and takes in the acknowledgements. Never needed
 * for correctness; a consumer that draws rarely calls it to keep samples flowing. Not
 * collective. */
fullshard_status fullshard_store_progress(fullshard_store store);

/** This rank's counters (fullshard_store_stats). */
typedef struct fullshard_store_stats_info {
  int64_t produced;   /* puts sent (producer) */
  int64_t dropped;    /* puts not sent: no credit (nonblocking) or non-finite (drop policy) */
  int64_t non_finite; /* puts with a NaN or an infinity, refused or dropped (a put dropped for
                         want of credit is not checked) */
  int64_t ingested;   /* samples taken into this consumer's buffer */
  int64_t drawn;      /* samples returned by draws */
  int64_t reused;     /* draws of a sample drawn before */
  int64_t evicted;    /* samples the policy replaced or pushed out of the buffer */
  int64_t rejected;   /* reservoir: ingested samples algorithm R did not keep */
  /* lossless: samples that arrived but were never ingested, discarded (and acknowledged) by
     fullshard_store_close; not in ingested, evicted or the moments */
  int64_t discarded_at_close;
  /* mean over the drawn samples of (the newest step ingested at the draw) - (their step) */
  double mean_staleness;
  int64_t bytes; /* what fullshard_store_bytes gives */
} fullshard_store_stats_info;
/** This rank's counters. Also after fullshard_store_close. Not collective. */
fullshard_status fullshard_store_stats(fullshard_store store, fullshard_store_stats_info* stats);

/** Running moments of one field over all its elements (population standard deviation). */
typedef struct fullshard_field_moments {
  int64_t count; /* elements seen */
  double mean;
  double stddev;
} fullshard_field_moments;
/** The mean and standard deviation of field `field` over every element of every sample this
 * rank ingested (count 0 on a rank that is only a producer): what normalises the inputs. An
 * unknown field or a mask is FULLSHARD_ERR_ARGUMENT naming it. Also after close. Not
 * collective. */
fullshard_status fullshard_store_moments(fullshard_store store, const char* field,
                                         fullshard_field_moments* moments);
/** The consumers' moments of `field` merged, the same on every rank. Collective over the
 * store's communicator. */
fullshard_status fullshard_store_global_moments(fullshard_store store, const char* field,
                                                fullshard_field_moments* moments);
/** `*bytes`: what this rank holds for the store (the buffer's slots, allocated as samples
 * arrive, the staging of received samples and the producer's send rings); `*sample_bytes` (may be
 * NULL): one sample, every field in its stored dtype, each 8-byte aligned. Not collective. */
fullshard_status fullshard_store_bytes(fullshard_store store, int64_t* bytes,
                                       int64_t* sample_bytes);

/** Ends the store's traffic so that no message is left in flight: producers end their stream,
 * consumers receive up to every producer's end and acknowledge. A consumer in close keeps
 * acknowledging what arrives, so producers still putting go on until they close too
 * (nonblocking: ingested, never drawn; lossless: discarded, counted in discarded_at_close);
 * samples not drawn are lost. Collective over the store's communicator; every wait bounded by
 * the timeout.
 * Afterwards only fullshard_store_stats, fullshard_store_moments, fullshard_store_ended,
 * fullshard_store_bytes and fullshard_store_free take the handle. */
fullshard_status fullshard_store_close(fullshard_store store);
/** Frees the store and sets *store to {0}; the null handle is FULLSHARD_OK. Not collective and
 * never waits: call fullshard_store_close first (without it, on an error path, sends still in
 * flight are left to MPI, and the store's communicator is kept until MPI_Finalize so that
 * messages still on their way never reach a later communicator). fullshard_finalize frees the
 * stores still alive the same way. */
fullshard_status fullshard_store_free(fullshard_store* store);

#ifdef __cplusplus
}
#endif

#endif /* FULLSHARD_H */
