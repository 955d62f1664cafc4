! The Fortran module of fullshard (`use fullshard`): sharded training of a LibTorch model from
! a Fortran simulation, over the C API (include/fullshard/fullshard.h).
!
! - Communicators: mpi_f08's type(MPI_Comm) or an integer handle (MPI_Comm_f2c underneath).
! - Arrays: any rank, real(c_float) / real(c_double) / integer(c_int32_t) / integer(c_int64_t),
!   sections included (used in place, no copy). Column-major: the Fortran array x(f, n) is the
!   LibTorch tensor of shape (n, f), so put the samples (batch) in the LAST dimension and the
!   features in the first: x(features, samples), field(nx, ny, channels, samples).
! - The in-situ sample store (fullshard_store_*): fields are declared with their shapes in
!   Fortran order, as the arrays are: a field of shape [n1, n2] is put as a(n1, n2) and drawn as
!   ab(n1, n2, batch) (the samples in the last dimension); the module reverses the shapes for the
!   C API (the C shape is [n2, n1], the batch [batch, n2, n1]: the same memory), so a Fortran
!   array round-trips exactly. Up to 6 fields from Fortran.
! - Errors: every procedure has an optional `status`. Present: it receives FULLSHARD_OK or an
!   error code (fullshard_last_error() says what was wrong). Absent: an error prints the
!   message and calls MPI_Abort on the communicator given to fullshard_init, so that no rank
!   is left waiting in a collective.
! - The .mod file works only with the Fortran compiler (and version) that built it.
module fullshard
  use, intrinsic :: iso_c_binding
  use, intrinsic :: iso_fortran_env, only: error_unit
  use mpi_f08, only: MPI_Comm, MPI_Abort, MPI_COMM_WORLD
  implicit none
  private

  integer, parameter, public :: FULLSHARD_OK = 0, FULLSHARD_ERR_NOT_INITIALIZED = 1, &
                                FULLSHARD_ERR_HANDLE = 2, FULLSHARD_ERR_ARGUMENT = 3, &
                                FULLSHARD_ERR_CONFIG = 4, FULLSHARD_ERR_MISMATCH = 5, &
                                FULLSHARD_ERR_COMM = 6, FULLSHARD_ERR_IO = 7, &
                                FULLSHARD_ERR_INFEASIBLE = 8, FULLSHARD_ERR_INTERNAL = 9
  !> Element types (the C API's fullshard_dtype): a store field is FULLSHARD_FLOAT32 or
  !> FULLSHARD_FLOAT64.
  integer, parameter, public :: FULLSHARD_FLOAT32 = 0, FULLSHARD_FLOAT64 = 1, &
                                FULLSHARD_INT32 = 2, FULLSHARD_INT64 = 3
  !> A rank's role in a sample store.
  integer, parameter, public :: FULLSHARD_STORE_PRODUCER = 0, FULLSHARD_STORE_CONSUMER = 1, &
                                FULLSHARD_STORE_BOTH = 2
  !> A store's buffer policy: algorithm R (uniform over everything ingested), a bounded queue
  !> (oldest first, each once), the last `window` samples.
  integer, parameter, public :: FULLSHARD_STORE_RESERVOIR = 0, FULLSHARD_STORE_FIFO = 1, &
                                FULLSHARD_STORE_WINDOW = 2
  !> A store's delivery: puts never wait (samples without credit are dropped), or no sample is
  !> lost in transit and a run is reproducible (puts wait for credit, ingestion in a fixed
  !> order; the policy may still evict, and close discards what was never ingested).
  integer, parameter, public :: FULLSHARD_STORE_NONBLOCKING = 0, FULLSHARD_STORE_LOSSLESS = 1
  !> What a put does with a NaN or an infinity: refuses it (an error) or drops the sample.
  integer, parameter, public :: FULLSHARD_STORE_REFUSE = 0, FULLSHARD_STORE_DROP = 1

  !> A device mesh (0: none).
  type, public :: fullshard_mesh
    integer(c_int64_t) :: id = 0
  end type
  !> A model (0: none).
  type, public :: fullshard_model
    integer(c_int64_t) :: id = 0
  end type
  !> An asynchronous checkpoint save in flight (0: none).
  type, public :: fullshard_save
    integer(c_int64_t) :: id = 0
  end type
  !> What the planner predicted for one training step (fullshard_model_plan).
  type, public, bind(C) :: fullshard_plan_info
    real(c_double) :: step_ms
    integer(c_int64_t) :: peak_bytes, sharded_bytes, groups
    integer(c_int64_t) :: process_peak_bytes  !< the rank's planned process peak (docs/memory.md)
    integer(c_int64_t) :: calibrated_iterations  !< 0: default module costs; n: measured over n
    real(c_double) :: optimizer_ms               !< the optimizer's measured step (calibrated)
    real(c_double) :: communication_scale        !< measured over modelled collectives (1 before)
  end type
  !> This rank's memory by part, in bytes (fullshard_model_memory; docs/memory.md).
  type, public, bind(C) :: fullshard_memory_parts
    integer(c_int64_t) :: baseline, shards, gradients, optimizer_state, pool, windows
    integer(c_int64_t) :: activations   !< LibTorch's, measured by the first train step
    integer(c_int64_t) :: untracked     !< beyond every part at a step's peak (measured)
    integer(c_int64_t) :: process_peak  !< planned: the sum; measured: the process's share
  end type

  !> A sample store (0: none): fullshard_store_create.
  type, public :: fullshard_store
    integer(c_int64_t) :: id = 0
  end type
  !> This rank's counters of a sample store (fullshard_store_stats).
  type, public, bind(C) :: fullshard_store_stats_info
    integer(c_int64_t) :: produced    !< puts sent
    integer(c_int64_t) :: dropped     !< puts not sent: no credit (nonblocking) or non-finite
    integer(c_int64_t) :: non_finite  !< puts with a NaN or an infinity (refused or dropped)
    integer(c_int64_t) :: ingested    !< samples taken into this consumer's buffer
    integer(c_int64_t) :: drawn       !< samples returned by draws
    integer(c_int64_t) :: reused      !< draws of a sample drawn before
    integer(c_int64_t) :: evicted     !< samples the policy replaced or pushed out
    integer(c_int64_t) :: rejected    !< reservoir: ingested samples algorithm R did not keep
    !> lossless: samples that arrived but were never ingested, discarded by close
    integer(c_int64_t) :: discarded_at_close
    real(c_double) :: mean_staleness  !< mean (newest step ingested - sample's step) of draws
    integer(c_int64_t) :: bytes       !< what fullshard_store_bytes gives
  end type
  !> Running moments of one field over all its elements (fullshard_store_moments).
  type, public, bind(C) :: fullshard_field_moments
    integer(c_int64_t) :: count  !< elements seen
    real(c_double) :: mean, stddev  !< population standard deviation
  end type

  ! One field of fullshard_store_options, as declared (its shape in Fortran order).
  type :: store_field
    character(:), allocatable :: name
    integer(c_int64_t), allocatable :: shape(:)
    integer :: dtype = FULLSHARD_FLOAT32
    logical :: store_as_f32 = .false., mask = .false.
  end type

  !> A sample store's options (fullshard_store_create): add the fields in order with
  !> add_field(name, shape [, dtype] [, store_as_f32] [, mask]), shape in Fortran order (absent:
  !> a scalar); set the rest as components. Every rank passes the same (compared).
  type, public :: fullshard_store_options
    type(store_field), allocatable, private :: fields(:)
    integer, private :: n_fields = 0
    integer :: policy = FULLSHARD_STORE_RESERVOIR     !< or FULLSHARD_STORE_FIFO, _WINDOW
    integer :: delivery = FULLSHARD_STORE_NONBLOCKING !< or FULLSHARD_STORE_LOSSLESS
    integer :: non_finite = FULLSHARD_STORE_REFUSE    !< or FULLSHARD_STORE_DROP
    integer(c_int64_t) :: capacity = 1024  !< samples each consumer's buffer holds
    integer(c_int64_t) :: window = 0       !< FULLSHARD_STORE_WINDOW: last samples (0: capacity)
    integer(c_int64_t) :: in_flight = 4    !< samples in transit per producer and consumer
    integer(c_int64_t) :: ingest_per_draw = 0  !< lossless: samples ingested per draw (0: batch)
    !> reservoir, window: a draw waits until the buffer holds this many (1 to the bound), then
    !> draws its batch with replacement from them; a FIFO draw waits for its whole batch
    integer(c_int64_t) :: min_samples = 1
    integer(c_int64_t) :: seed = 0         !< the consumers' random choices
    real(c_double) :: timeout_s = 0        !< bound on every wait, s (0: FULLSHARD_TIMEOUT)
    character(:), allocatable :: name      !< in messages (unset: "store")
  contains
    procedure :: add_field => store_options_add_field
  end type

  ! The C structs (fullshard_mesh / fullshard_model are one uint64_t; Fortran has no unsigned
  ! integers: the same 64 bits in an int64).
  type, bind(C) :: c_handle
    integer(c_int64_t) :: id
  end type
  type, bind(C) :: c_array
    type(c_ptr) :: data
    integer(c_int32_t) :: dtype, ndim
    integer(c_int64_t) :: shape(8), strides(8)
  end type
  type, bind(C) :: c_store_field
    type(c_ptr) :: name
    integer(c_int32_t) :: dtype, ndim
    integer(c_int64_t) :: shape(8)
    integer(c_int32_t) :: store_as_f32, mask
  end type
  type, bind(C) :: c_store_options
    type(c_ptr) :: fields
    integer(c_int32_t) :: n_fields, policy, delivery, non_finite
    integer(c_int64_t) :: capacity, window, in_flight, ingest_per_draw, min_samples, seed
    real(c_double) :: timeout_s
    type(c_ptr) :: name
  end type

  !> Several arrays for one call (models with several inputs or outputs): add them in order;
  !> the arrays must stay alive and unchanged in shape until the call that uses the list.
  type, public :: fullshard_arrays
    type(c_array), allocatable :: items(:)
    integer :: n = 0
  contains
    procedure :: add => arrays_add
    procedure :: clear => arrays_clear
  end type

  public :: fullshard_init, fullshard_finalize, fullshard_initialized, fullshard_last_error
  public :: fullshard_mesh_create, fullshard_mesh_free
  public :: fullshard_model_create, fullshard_model_create_from_json, fullshard_model_free
  public :: fullshard_train_step, fullshard_predict
  public :: fullshard_model_step, fullshard_model_lr, fullshard_model_num_params
  public :: fullshard_model_skipped_steps
  public :: fullshard_model_plan, fullshard_model_memory
  public :: fullshard_checkpoint_save, fullshard_checkpoint_load, fullshard_export_safetensors
  public :: fullshard_checkpoint_save_async, fullshard_save_test, fullshard_save_wait
  public :: fullshard_store_create, fullshard_store_put, fullshard_store_end_of_stream
  public :: fullshard_store_draw, fullshard_store_ended, fullshard_store_progress
  public :: fullshard_store_stats, fullshard_store_moments, fullshard_store_global_moments
  public :: fullshard_store_bytes, fullshard_store_close, fullshard_store_free

  !> fullshard_init(comm [, status]): comm is type(MPI_Comm) or an integer handle. Collective.
  interface fullshard_init
    module procedure init_f08, init_int
  end interface
  !> fullshard_mesh_create(comm, shape, names, mesh [, device] [, status]). Collective.
  interface fullshard_mesh_create
    module procedure mesh_create_f08, mesh_create_int
  end interface
  !> fullshard_train_step(model, x, y [, loss] [, status]), or with fullshard_arrays lists
  !> (inputs, targets). Collective over the model's mesh.
  interface fullshard_train_step
    module procedure train_step_one, train_step_list
  end interface
  !> fullshard_predict(model, x, y [, status]), or with lists. Collective.
  interface fullshard_predict
    module procedure predict_one, predict_list
  end interface

  !> fullshard_store_create(comm, role, options, store [, status]): comm is type(MPI_Comm) or
  !> an integer handle; role FULLSHARD_STORE_PRODUCER, _CONSUMER or _BOTH. Collective.
  interface fullshard_store_create
    module procedure store_create_f08, store_create_int
  end interface
  !> fullshard_store_put(store, step, tag, f1 [, f2, ..., f6] [, sent] [, status]): one sample,
  !> one array per field in the declared order; step and tag both default integers or both
  !> integer(c_int64_t).
  interface fullshard_store_put
    module procedure store_put_int, store_put_int64
  end interface

  ! The communicator MPI_Abort uses when an error has no status argument to go to.
  type(MPI_Comm) :: abort_comm

  interface
    function c_init_f(comm) bind(C, name="fullshard_init_f") result(s)
      import :: c_int
      integer(c_int), value :: comm
      integer(c_int) :: s
    end function
    function c_finalize() bind(C, name="fullshard_finalize") result(s)
      import :: c_int
      integer(c_int) :: s
    end function
    function c_initialized() bind(C, name="fullshard_initialized") result(s)
      import :: c_int
      integer(c_int) :: s
    end function
    function c_last_error() bind(C, name="fullshard_last_error") result(p)
      import :: c_ptr
      type(c_ptr) :: p
    end function
    function c_mesh_create_f(comm, device, ndim, shape, names, mesh) &
        bind(C, name="fullshard_mesh_create_f") result(s)
      import :: c_int, c_char, c_handle
      integer(c_int), value :: comm, ndim
      character(kind=c_char), intent(in) :: device(*), names(*)
      integer(c_int), intent(in) :: shape(*)
      type(c_handle), intent(out) :: mesh
      integer(c_int) :: s
    end function
    function c_mesh_free(mesh) bind(C, name="fullshard_mesh_free") result(s)
      import :: c_int, c_handle
      type(c_handle), intent(inout) :: mesh
      integer(c_int) :: s
    end function
    function c_model_create(mesh, path, model) bind(C, name="fullshard_model_create") result(s)
      import :: c_int, c_char, c_handle
      type(c_handle), value :: mesh
      character(kind=c_char), intent(in) :: path(*)
      type(c_handle), intent(out) :: model
      integer(c_int) :: s
    end function
    function c_model_create_json(mesh, json, source, model) &
        bind(C, name="fullshard_model_create_from_json") result(s)
      import :: c_int, c_char, c_handle
      type(c_handle), value :: mesh
      character(kind=c_char), intent(in) :: json(*), source(*)
      type(c_handle), intent(out) :: model
      integer(c_int) :: s
    end function
    function c_model_free(model) bind(C, name="fullshard_model_free") result(s)
      import :: c_int, c_handle
      type(c_handle), intent(inout) :: model
      integer(c_int) :: s
    end function
    function c_train_step(model, n_in, inputs, n_tg, targets, loss) &
        bind(C, name="fullshard_train_step") result(s)
      import :: c_int, c_handle, c_array, c_double
      type(c_handle), value :: model
      integer(c_int), value :: n_in, n_tg
      type(c_array), intent(in) :: inputs(*), targets(*)
      real(c_double), intent(out) :: loss
      integer(c_int) :: s
    end function
    function c_predict(model, n_in, inputs, n_out, outputs) &
        bind(C, name="fullshard_predict") result(s)
      import :: c_int, c_handle, c_array
      type(c_handle), value :: model
      integer(c_int), value :: n_in, n_out
      type(c_array), intent(in) :: inputs(*), outputs(*)
      integer(c_int) :: s
    end function
    function c_model_lr(model, v) bind(C, name="fullshard_model_lr") result(s)
      import :: c_int, c_handle, c_double
      type(c_handle), value :: model
      real(c_double), intent(out) :: v
      integer(c_int) :: s
    end function
    function c_model_plan(model, info) bind(C, name="fullshard_model_plan") result(s)
      import :: c_int, c_handle, fullshard_plan_info
      type(c_handle), value :: model
      type(fullshard_plan_info), intent(out) :: info
      integer(c_int) :: s
    end function
    function c_model_memory(model, planned, measured) bind(C, name="fullshard_model_memory") &
        result(s)
      import :: c_int, c_handle, fullshard_memory_parts
      type(c_handle), value :: model
      type(fullshard_memory_parts), intent(out) :: planned, measured
      integer(c_int) :: s
    end function
    function c_describe(x, what, out) bind(C, name="fullshard_fortran_describe") result(s)
      import :: c_int, c_char, c_array
      type(*), dimension(..), intent(in) :: x
      character(kind=c_char), intent(in) :: what(*)
      type(c_array), intent(out) :: out
      integer(c_int) :: s
    end function
    function c_checkpoint_save_async(model, dir, save) &
        bind(C, name="fullshard_checkpoint_save_async") result(s)
      import :: c_int, c_handle, c_char
      type(c_handle), value :: model
      character(kind=c_char), intent(in) :: dir(*)
      type(c_handle), intent(out) :: save
      integer(c_int) :: s
    end function
    function c_save_test(save, done) bind(C, name="fullshard_save_test") result(s)
      import :: c_int, c_handle
      type(c_handle), intent(inout) :: save
      integer(c_int), intent(out) :: done
      integer(c_int) :: s
    end function
    function c_save_wait(save) bind(C, name="fullshard_save_wait") result(s)
      import :: c_int, c_handle
      type(c_handle), intent(inout) :: save
      integer(c_int) :: s
    end function
    function c_strlen(p) bind(C, name="strlen") result(n)
      import :: c_ptr, c_size_t
      type(c_ptr), value :: p
      integer(c_size_t) :: n
    end function
  end interface

  ! One explicit interface per C function: gfortran 12 passes a bind(C) derived type by value
  ! wrongly through `procedure(abstract interface), bind(C, name=...)` declarations (the
  ! handle arrived as the string's address), so none is declared that way.
  interface
    function c_model_step(model, v) bind(C, name="fullshard_model_step") result(s)
      import :: c_int, c_handle, c_int64_t
      type(c_handle), value :: model
      integer(c_int64_t), intent(out) :: v
      integer(c_int) :: s
    end function
    function c_model_skipped_steps(model, v) bind(C, name="fullshard_model_skipped_steps") &
        result(s)
      import :: c_int, c_handle, c_int64_t
      type(c_handle), value :: model
      integer(c_int64_t), intent(out) :: v
      integer(c_int) :: s
    end function
    function c_model_num_params(model, v) bind(C, name="fullshard_model_num_params") result(s)
      import :: c_int, c_handle, c_int64_t
      type(c_handle), value :: model
      integer(c_int64_t), intent(out) :: v
      integer(c_int) :: s
    end function
    function c_checkpoint_save(model, path) bind(C, name="fullshard_checkpoint_save") result(s)
      import :: c_int, c_handle, c_char
      type(c_handle), value :: model
      character(kind=c_char), intent(in) :: path(*)
      integer(c_int) :: s
    end function
    function c_checkpoint_load(model, path) bind(C, name="fullshard_checkpoint_load") result(s)
      import :: c_int, c_handle, c_char
      type(c_handle), value :: model
      character(kind=c_char), intent(in) :: path(*)
      integer(c_int) :: s
    end function
    function c_export_safetensors(model, path) &
        bind(C, name="fullshard_export_safetensors") result(s)
      import :: c_int, c_handle, c_char
      type(c_handle), value :: model
      character(kind=c_char), intent(in) :: path(*)
      integer(c_int) :: s
    end function
  end interface

  ! The sample store's C functions (include/fullshard/fullshard.h).
  interface
    function c_store_create_f(comm, role, options, store) bind(C, name="fullshard_store_create_f") &
        result(s)
      import :: c_int, c_handle, c_store_options
      integer(c_int), value :: comm, role
      type(c_store_options), intent(in) :: options
      type(c_handle), intent(out) :: store
      integer(c_int) :: s
    end function
    function c_store_put_arrays(store, step, tag, n, fields, sent) &
        bind(C, name="fullshard_store_put_arrays") result(s)
      import :: c_int, c_int64_t, c_handle, c_array
      type(c_handle), value :: store
      integer(c_int64_t), value :: step, tag
      integer(c_int), value :: n
      type(c_array), intent(in) :: fields(*)
      integer(c_int), intent(out) :: sent
      integer(c_int) :: s
    end function
    function c_store_draw_arrays(store, batch, n, out, steps, ranks, tags, drawn) &
        bind(C, name="fullshard_store_draw_arrays") result(s)
      import :: c_int, c_int64_t, c_handle, c_array
      type(c_handle), value :: store
      integer(c_int64_t), value :: batch
      integer(c_int), value :: n
      type(c_array), intent(in) :: out(*)
      integer(c_int64_t), intent(out), optional :: steps(*), tags(*)
      integer(c_int), intent(out), optional :: ranks(*)
      integer(c_int64_t), intent(out) :: drawn
      integer(c_int) :: s
    end function
    function c_store_end_of_stream(store) bind(C, name="fullshard_store_end_of_stream") result(s)
      import :: c_int, c_handle
      type(c_handle), value :: store
      integer(c_int) :: s
    end function
    function c_store_ended(store, ended) bind(C, name="fullshard_store_ended") result(s)
      import :: c_int, c_handle
      type(c_handle), value :: store
      integer(c_int), intent(out) :: ended
      integer(c_int) :: s
    end function
    function c_store_progress(store) bind(C, name="fullshard_store_progress") result(s)
      import :: c_int, c_handle
      type(c_handle), value :: store
      integer(c_int) :: s
    end function
    function c_store_stats(store, stats) bind(C, name="fullshard_store_stats") result(s)
      import :: c_int, c_handle, fullshard_store_stats_info
      type(c_handle), value :: store
      type(fullshard_store_stats_info), intent(out) :: stats
      integer(c_int) :: s
    end function
    function c_store_moments(store, field, moments) bind(C, name="fullshard_store_moments") &
        result(s)
      import :: c_int, c_char, c_handle, fullshard_field_moments
      type(c_handle), value :: store
      character(kind=c_char), intent(in) :: field(*)
      type(fullshard_field_moments), intent(out) :: moments
      integer(c_int) :: s
    end function
    function c_store_global_moments(store, field, moments) &
        bind(C, name="fullshard_store_global_moments") result(s)
      import :: c_int, c_char, c_handle, fullshard_field_moments
      type(c_handle), value :: store
      character(kind=c_char), intent(in) :: field(*)
      type(fullshard_field_moments), intent(out) :: moments
      integer(c_int) :: s
    end function
    function c_store_bytes(store, bytes, sample_bytes) bind(C, name="fullshard_store_bytes") &
        result(s)
      import :: c_int, c_int64_t, c_handle
      type(c_handle), value :: store
      integer(c_int64_t), intent(out) :: bytes, sample_bytes
      integer(c_int) :: s
    end function
    function c_store_close(store) bind(C, name="fullshard_store_close") result(s)
      import :: c_int, c_handle
      type(c_handle), value :: store
      integer(c_int) :: s
    end function
    function c_store_free(store) bind(C, name="fullshard_store_free") result(s)
      import :: c_int, c_handle
      type(c_handle), intent(inout) :: store
      integer(c_int) :: s
    end function
    function c_describe_sample(x, what, out) bind(C, name="fullshard_fortran_describe_sample") &
        result(s)
      import :: c_int, c_char, c_array
      type(*), dimension(..), intent(in) :: x
      character(kind=c_char), intent(in) :: what(*)
      type(c_array), intent(out) :: out
      integer(c_int) :: s
    end function
    function c_detail_fail(status, message) bind(C, name="fullshard_detail_fail") result(s)
      import :: c_int, c_char
      integer(c_int), value :: status
      character(kind=c_char), intent(in) :: message(*)
      integer(c_int) :: s
    end function
  end interface

contains

  !> The message of the last call that failed on this thread ("" if none did).
  function fullshard_last_error() result(msg)
    character(:), allocatable :: msg
    type(c_ptr) :: p
    character(kind=c_char), pointer :: chars(:)
    integer :: i, n
    p = c_last_error()
    n = int(c_strlen(p))
    call c_f_pointer(p, chars, [n])
    allocate (character(n) :: msg)
    do i = 1, n
      msg(i:i) = chars(i)
    end do
  end function

  ! Hands `code` to `status`, or (no status argument) stops the job on an error.
  subroutine finish(code, status)
    integer(c_int), intent(in) :: code
    integer, intent(out), optional :: status
    integer :: ierr
    if (present(status)) then
      status = int(code)
      return
    end if
    if (code == FULLSHARD_OK) return
    write (error_unit, '(a)') 'fullshard: '//fullshard_last_error()
    flush (error_unit)
    call MPI_Abort(abort_comm, int(code), ierr)
  end subroutine

  function cstr(s) result(c)
    character(*), intent(in) :: s
    character(kind=c_char, len=len_trim(s) + 1) :: c
    c = trim(s)//c_null_char
  end function

  ! A checkpoint directory argument: absent is '' (the configuration's checkpoint.dir).
  function cdir(dir) result(c)
    character(*), intent(in), optional :: dir
    character(kind=c_char, len=:), allocatable :: c
    if (present(dir)) then
      c = cstr(dir)
    else
      c = c_null_char
    end if
  end function

  ! ---- runtime ----------------------------------------------------------------------------

  subroutine init_f08(comm, status)
    type(MPI_Comm), intent(in) :: comm
    integer, intent(out), optional :: status
    call init_int(comm%MPI_VAL, status)
  end subroutine

  subroutine init_int(comm, status)
    integer, intent(in) :: comm
    integer, intent(out), optional :: status
    integer(c_int) :: code
    code = c_init_f(int(comm, c_int))
    abort_comm = MPI_COMM_WORLD
    if (code == FULLSHARD_OK) abort_comm%MPI_VAL = comm
    call finish(code, status)
  end subroutine

  !> Frees every mesh and model still alive. Collective.
  subroutine fullshard_finalize(status)
    integer, intent(out), optional :: status
    call finish(c_finalize(), status)
  end subroutine

  logical function fullshard_initialized()
    fullshard_initialized = c_initialized() /= 0
  end function

  ! ---- meshes -----------------------------------------------------------------------------

  subroutine mesh_create_f08(comm, shape, names, mesh, device, status)
    type(MPI_Comm), intent(in) :: comm
    integer, intent(in) :: shape(:)
    character(*), intent(in) :: names
    type(fullshard_mesh), intent(out) :: mesh
    character(*), intent(in), optional :: device
    integer, intent(out), optional :: status
    call mesh_create_int(comm%MPI_VAL, shape, names, mesh, device, status)
  end subroutine

  !> shape: ranks per dim (1 or 2 dims; a 2-D mesh is HSDP: replicated over the first,
  !> sharded over the second); names: "dp" or "replicate,shard"; device: "cpu" (default) or
  !> "cuda".
  subroutine mesh_create_int(comm, shape, names, mesh, device, status)
    integer, intent(in) :: comm
    integer, intent(in) :: shape(:)
    character(*), intent(in) :: names
    type(fullshard_mesh), intent(out) :: mesh
    character(*), intent(in), optional :: device
    integer, intent(out), optional :: status
    type(c_handle) :: h
    integer(c_int) :: code
    integer(c_int) :: cshape(size(shape))
    cshape = int(shape, c_int)
    if (present(device)) then
      code = c_mesh_create_f(int(comm, c_int), cstr(device), int(size(shape), c_int), cshape, &
                             cstr(names), h)
    else
      code = c_mesh_create_f(int(comm, c_int), cstr('cpu'), int(size(shape), c_int), cshape, &
                             cstr(names), h)
    end if
    mesh%id = h%id
    call finish(code, status)
  end subroutine

  subroutine fullshard_mesh_free(mesh, status)
    type(fullshard_mesh), intent(inout) :: mesh
    integer, intent(out), optional :: status
    type(c_handle) :: h
    integer(c_int) :: code
    h%id = mesh%id
    code = c_mesh_free(h)
    mesh%id = h%id
    call finish(code, status)
  end subroutine

  ! ---- models -----------------------------------------------------------------------------

  !> Builds and shards the model that the JSON file `config` describes. Collective.
  subroutine fullshard_model_create(mesh, config, model, status)
    type(fullshard_mesh), intent(in) :: mesh
    character(*), intent(in) :: config
    type(fullshard_model), intent(out) :: model
    integer, intent(out), optional :: status
    type(c_handle) :: h
    integer(c_int) :: code
    code = c_model_create(c_handle(mesh%id), cstr(config), h)
    model%id = h%id
    call finish(code, status)
  end subroutine

  !> The same from the configuration's text; `source` names it in messages (default
  !> "<string>"). Collective.
  subroutine fullshard_model_create_from_json(mesh, json, model, source, status)
    type(fullshard_mesh), intent(in) :: mesh
    character(*), intent(in) :: json
    type(fullshard_model), intent(out) :: model
    character(*), intent(in), optional :: source
    integer, intent(out), optional :: status
    type(c_handle) :: h
    integer(c_int) :: code
    if (present(source)) then
      code = c_model_create_json(c_handle(mesh%id), cstr(json), cstr(source), h)
    else
      code = c_model_create_json(c_handle(mesh%id), cstr(json), cstr('<string>'), h)
    end if
    model%id = h%id
    call finish(code, status)
  end subroutine

  !> Collective.
  subroutine fullshard_model_free(model, status)
    type(fullshard_model), intent(inout) :: model
    integer, intent(out), optional :: status
    type(c_handle) :: h
    integer(c_int) :: code
    h%id = model%id
    code = c_model_free(h)
    model%id = h%id
    call finish(code, status)
  end subroutine

  ! ---- arrays -----------------------------------------------------------------------------

  subroutine arrays_add(self, x, status)
    class(fullshard_arrays), intent(inout) :: self
    type(*), dimension(..), intent(in), target :: x
    integer, intent(out), optional :: status
    type(c_array), allocatable :: grown(:)
    integer(c_int) :: code
    if (.not. allocated(self%items)) allocate (self%items(4))
    if (self%n == size(self%items)) then
      allocate (grown(2*self%n))
      grown(1:self%n) = self%items(1:self%n)
      call move_alloc(grown, self%items)
    end if
    code = c_describe(x, cstr('fullshard_arrays%add'), self%items(self%n + 1))
    if (code == FULLSHARD_OK) self%n = self%n + 1
    call finish(code, status)
  end subroutine

  subroutine arrays_clear(self)
    class(fullshard_arrays), intent(inout) :: self
    self%n = 0
  end subroutine

  ! ---- training and inference -------------------------------------------------------------

  !> One optimizer step on this rank's batch: x(features.., samples), y(outputs.., samples);
  !> loss: this rank's loss. Collective.
  subroutine train_step_one(model, x, y, loss, status)
    type(fullshard_model), intent(in) :: model
    type(*), dimension(..), intent(in), target :: x, y
    real(c_double), intent(out), optional :: loss
    integer, intent(out), optional :: status
    type(c_array) :: a(1), b(1)
    real(c_double) :: l
    integer(c_int) :: code
    code = c_describe(x, cstr('fullshard_train_step: x'), a(1))
    if (code == FULLSHARD_OK) code = c_describe(y, cstr('fullshard_train_step: y'), b(1))
    if (code == FULLSHARD_OK) code = c_train_step(c_handle(model%id), 1_c_int, a, 1_c_int, b, l)
    if (code == FULLSHARD_OK .and. present(loss)) loss = l
    call finish(code, status)
  end subroutine

  subroutine train_step_list(model, inputs, targets, loss, status)
    type(fullshard_model), intent(in) :: model
    type(fullshard_arrays), intent(in) :: inputs, targets
    real(c_double), intent(out), optional :: loss
    integer, intent(out), optional :: status
    type(c_array) :: none(1)
    real(c_double) :: l
    integer(c_int) :: code
    if (inputs%n > 0 .and. targets%n > 0) then
      code = c_train_step(c_handle(model%id), int(inputs%n, c_int), inputs%items, &
                          int(targets%n, c_int), targets%items, l)
    else if (inputs%n > 0) then
      code = c_train_step(c_handle(model%id), int(inputs%n, c_int), inputs%items, 0_c_int, &
                          none, l)
    else
      code = c_train_step(c_handle(model%id), 0_c_int, none, int(targets%n, c_int), none, l)
    end if
    if (code == FULLSHARD_OK .and. present(loss)) loss = l
    call finish(code, status)
  end subroutine

  !> Inference: y receives the model's output for x (shapes as in train_step). Collective.
  subroutine predict_one(model, x, y, status)
    type(fullshard_model), intent(in) :: model
    type(*), dimension(..), intent(in), target :: x
    type(*), dimension(..), intent(inout), target :: y
    integer, intent(out), optional :: status
    type(c_array) :: a(1), b(1)
    integer(c_int) :: code
    code = c_describe(x, cstr('fullshard_predict: x'), a(1))
    if (code == FULLSHARD_OK) code = c_describe(y, cstr('fullshard_predict: y'), b(1))
    if (code == FULLSHARD_OK) code = c_predict(c_handle(model%id), 1_c_int, a, 1_c_int, b)
    call finish(code, status)
  end subroutine

  subroutine predict_list(model, inputs, outputs, status)
    type(fullshard_model), intent(in) :: model
    type(fullshard_arrays), intent(in) :: inputs, outputs
    integer, intent(out), optional :: status
    type(c_array) :: none(1)
    integer(c_int) :: code
    if (inputs%n > 0 .and. outputs%n > 0) then
      code = c_predict(c_handle(model%id), int(inputs%n, c_int), inputs%items, &
                       int(outputs%n, c_int), outputs%items)
    else
      code = c_predict(c_handle(model%id), int(inputs%n, c_int), none, int(outputs%n, c_int), &
                       none)
    end if
    call finish(code, status)
  end subroutine

  ! ---- state ------------------------------------------------------------------------------

  subroutine fullshard_model_step(model, step, status)
    type(fullshard_model), intent(in) :: model
    integer(c_int64_t), intent(out) :: step
    integer, intent(out), optional :: status
    call finish(c_model_step(c_handle(model%id), step), status)
  end subroutine

  ! Steps skipped for a non-finite value (the C API's fullshard_model_skipped_steps).
  subroutine fullshard_model_skipped_steps(model, count, status)
    type(fullshard_model), intent(in) :: model
    integer(c_int64_t), intent(out) :: count
    integer, intent(out), optional :: status
    call finish(c_model_skipped_steps(c_handle(model%id), count), status)
  end subroutine

  subroutine fullshard_model_lr(model, lr, status)
    type(fullshard_model), intent(in) :: model
    real(c_double), intent(out) :: lr
    integer, intent(out), optional :: status
    call finish(c_model_lr(c_handle(model%id), lr), status)
  end subroutine

  subroutine fullshard_model_num_params(model, count, status)
    type(fullshard_model), intent(in) :: model
    integer(c_int64_t), intent(out) :: count
    integer, intent(out), optional :: status
    call finish(c_model_num_params(c_handle(model%id), count), status)
  end subroutine

  !> The planner's prediction for one step (before any step ran).
  subroutine fullshard_model_plan(model, info, status)
    type(fullshard_model), intent(in) :: model
    type(fullshard_plan_info), intent(out) :: info
    integer, intent(out), optional :: status
    call finish(c_model_plan(c_handle(model%id), info), status)
  end subroutine

  !> This rank's memory by part: `planned` (the plan's account; the activations from the
  !> first train step on) and `measured` (the library's parts held now, the process's peak
  !> less the peers' shared-memory pages it maps).
  subroutine fullshard_model_memory(model, planned, measured, status)
    type(fullshard_model), intent(in) :: model
    type(fullshard_memory_parts), intent(out) :: planned, measured
    integer, intent(out), optional :: status
    call finish(c_model_memory(c_handle(model%id), planned, measured), status)
  end subroutine

  !> A new step directory under `dir` (absent or '': the configuration's checkpoint dir;
  !> loads on any number of ranks). Waits for an asynchronous save in flight first. Collective.
  subroutine fullshard_checkpoint_save(model, dir, status)
    type(fullshard_model), intent(in) :: model
    character(*), intent(in), optional :: dir
    integer, intent(out), optional :: status
    call finish(c_checkpoint_save(c_handle(model%id), cdir(dir)), status)
  end subroutine

  !> Starts saving in the background (`dir` as fullshard_checkpoint_save's): returns once this
  !> rank's state is copied into host memory; fullshard_save_test at step boundaries, or
  !> fullshard_save_wait, commits. One save per model at a time. Collective.
  subroutine fullshard_checkpoint_save_async(model, save, dir, status)
    type(fullshard_model), intent(in) :: model
    type(fullshard_save), intent(out) :: save
    character(*), intent(in), optional :: dir
    integer, intent(out), optional :: status
    type(c_handle) :: h
    integer(c_int) :: code
    h%id = 0
    code = c_checkpoint_save_async(c_handle(model%id), cdir(dir), h)
    save%id = h%id
    call finish(code, status)
  end subroutine

  !> Commits the save once every rank's files are written: done = .true. and save is reset
  !> (finished); .false. while they are being written. Collective.
  subroutine fullshard_save_test(save, done, status)
    type(fullshard_save), intent(inout) :: save
    logical, intent(out) :: done
    integer, intent(out), optional :: status
    type(c_handle) :: h
    integer(c_int) :: d, code
    h%id = save%id
    d = 0
    code = c_save_test(h, d)
    save%id = h%id
    done = d /= 0
    call finish(code, status)
  end subroutine

  !> Waits for the save and commits it; resets save. Collective.
  subroutine fullshard_save_wait(save, status)
    type(fullshard_save), intent(inout) :: save
    integer, intent(out), optional :: status
    type(c_handle) :: h
    integer(c_int) :: code
    h%id = save%id
    code = c_save_wait(h)
    save%id = h%id
    call finish(code, status)
  end subroutine

  !> The latest checkpoint under `dir` (absent or '': the configuration's), saved on any
  !> number of ranks. Collective.
  subroutine fullshard_checkpoint_load(model, dir, status)
    type(fullshard_model), intent(in) :: model
    character(*), intent(in), optional :: dir
    integer, intent(out), optional :: status
    call finish(c_checkpoint_load(c_handle(model%id), cdir(dir)), status)
  end subroutine

  !> The full parameters as one safetensors file (rank 0 writes it). Collective.
  subroutine fullshard_export_safetensors(model, path, status)
    type(fullshard_model), intent(in) :: model
    character(*), intent(in) :: path
    integer, intent(out), optional :: status
    call finish(c_export_safetensors(c_handle(model%id), cstr(path)), status)
  end subroutine

  ! ---- the in-situ sample store -----------------------------------------------------------

  !> Adds a field to the options, after those added before (put and draw take the arrays in
  !> this order): `shape` is one sample's shape in Fortran order, as its arrays have it (absent:
  !> a scalar); a draw's arrays add the batch as their last dim. dtype: FULLSHARD_FLOAT32
  !> (default) or FULLSHARD_FLOAT64. store_as_f32: a FULLSHARD_FLOAT64 field kept as float32
  !> (puts take real(c_double) or real(c_float), draws give real(c_float)). mask: elements 0 or
  !> 1 (checked at put), no moments.
  subroutine store_options_add_field(self, name, shape, dtype, store_as_f32, mask)
    class(fullshard_store_options), intent(inout) :: self
    character(*), intent(in) :: name
    integer, intent(in), optional :: shape(:)
    integer, intent(in), optional :: dtype
    logical, intent(in), optional :: store_as_f32, mask
    type(store_field), allocatable :: grown(:)
    if (.not. allocated(self%fields)) allocate (self%fields(4))
    if (self%n_fields >= size(self%fields)) then
      allocate (grown(max(4, 2*self%n_fields)))
      grown(1:self%n_fields) = self%fields(1:self%n_fields)
      call move_alloc(grown, self%fields)
    end if
    self%n_fields = self%n_fields + 1
    associate (f => self%fields(self%n_fields))
      f%name = trim(name)
      if (present(shape)) then
        f%shape = int(shape, c_int64_t)
      else
        allocate (f%shape(0))
      end if
      if (present(dtype)) f%dtype = dtype
      if (present(store_as_f32)) f%store_as_f32 = store_as_f32
      if (present(mask)) f%mask = mask
    end associate
  end subroutine

  subroutine store_create_f08(comm, role, options, store, status)
    type(MPI_Comm), intent(in) :: comm
    integer, intent(in) :: role
    type(fullshard_store_options), intent(in) :: options
    type(fullshard_store), intent(out) :: store
    integer, intent(out), optional :: status
    call store_create_int(comm%MPI_VAL, role, options, store, status)
  end subroutine

  !> A sample store over the ranks of comm, this rank in `role`: bad options on any rank are
  !> FULLSHARD_ERR_ARGUMENT on every rank (the first bad rank's problem); then the ranks compare
  !> their options (FULLSHARD_ERR_MISMATCH naming the first difference) and there must be a
  !> producer and a consumer. The field shapes are reversed for the C API (C order). Collective.
  subroutine store_create_int(comm, role, options, store, status)
    integer, intent(in) :: comm, role
    type(fullshard_store_options), intent(in) :: options
    type(fullshard_store), intent(out) :: store
    integer, intent(out), optional :: status
    type(c_store_field), allocatable, target :: cf(:)
    character(kind=c_char), allocatable, target :: names(:), cname(:)
    type(c_store_options) :: co
    type(c_handle) :: h
    integer :: i, j, at, total, nd, nf
    integer(c_int) :: code
    nf = 0
    if (allocated(options%fields)) nf = min(options%n_fields, size(options%fields))
    total = 1
    do i = 1, nf
      total = total + len(options%fields(i)%name) + 1
    end do
    allocate (cf(max(nf, 1)), names(total))
    at = 1
    do i = 1, nf
      associate (f => options%fields(i))
        cf(i)%name = c_loc(names(at))
        do j = 1, len(f%name)
          names(at) = f%name(j:j)
          at = at + 1
        end do
        names(at) = c_null_char
        at = at + 1
        nd = size(f%shape)
        cf(i)%dtype = int(f%dtype, c_int32_t)
        cf(i)%ndim = int(nd, c_int32_t)
        cf(i)%shape = 0
        do j = 1, min(nd, 8)  ! Fortran order, reversed: the C order
          cf(i)%shape(j) = f%shape(nd + 1 - j)
        end do
        cf(i)%store_as_f32 = merge(1_c_int32_t, 0_c_int32_t, f%store_as_f32)
        cf(i)%mask = merge(1_c_int32_t, 0_c_int32_t, f%mask)
      end associate
    end do
    co%fields = c_null_ptr
    if (nf > 0) co%fields = c_loc(cf(1))
    co%n_fields = int(nf, c_int32_t)
    co%policy = int(options%policy, c_int32_t)
    co%delivery = int(options%delivery, c_int32_t)
    co%non_finite = int(options%non_finite, c_int32_t)
    co%capacity = options%capacity
    co%window = options%window
    co%in_flight = options%in_flight
    co%ingest_per_draw = options%ingest_per_draw
    co%min_samples = options%min_samples
    co%seed = options%seed
    co%timeout_s = options%timeout_s
    co%name = c_null_ptr
    if (allocated(options%name)) then
      allocate (cname(len_trim(options%name) + 1))
      do j = 1, len_trim(options%name)
        cname(j) = options%name(j:j)
      end do
      cname(size(cname)) = c_null_char
      co%name = c_loc(cname(1))
    end if
    h%id = 0
    code = c_store_create_f(int(comm, c_int), int(role, c_int), co, h)
    store%id = h%id
    call finish(code, status)
  end subroutine

  function int_text(i) result(t)
    integer(c_int64_t), intent(in) :: i
    character(:), allocatable :: t
    character(24) :: buf
    write (buf, '(i0)') i
    t = trim(buf)
  end function

  ! The arrays f1 .. f6 (the first ones given, in order) as C arrays a(1:n); a scalar only for
  ! a sample (put).
  subroutine describe_fields(what, sample, a, n, code, f1, f2, f3, f4, f5, f6)
    character(*), intent(in) :: what
    logical, intent(in) :: sample
    type(c_array), intent(out) :: a(6)
    integer, intent(out) :: n
    integer(c_int), intent(out) :: code
    type(*), dimension(..), intent(in), target :: f1
    type(*), dimension(..), intent(in), target, optional :: f2, f3, f4, f5, f6
    logical :: given(6)
    integer :: gap
    given = [.true., present(f2), present(f3), present(f4), present(f5), present(f6)]
    n = count(given)
    gap = findloc(given, .false., dim=1)
    if (gap > 0 .and. gap < findloc(given, .true., dim=1, back=.true.)) then
      code = c_detail_fail(FULLSHARD_ERR_ARGUMENT, cstr(what//': f'//achar(48 + gap + 1)// &
                           ' is given without f'//achar(48 + gap)// &
                           ' (the arrays are the fields in their declared order)'))
      return
    end if
    code = one(f1, 1)
    if (code == FULLSHARD_OK .and. present(f2)) code = one(f2, 2)
    if (code == FULLSHARD_OK .and. present(f3)) code = one(f3, 3)
    if (code == FULLSHARD_OK .and. present(f4)) code = one(f4, 4)
    if (code == FULLSHARD_OK .and. present(f5)) code = one(f5, 5)
    if (code == FULLSHARD_OK .and. present(f6)) code = one(f6, 6)
  contains
    integer(c_int) function one(x, k)
      type(*), dimension(..), intent(in), target :: x
      integer, intent(in) :: k
      if (sample) then
        one = c_describe_sample(x, cstr(what//': f'//achar(48 + k)), a(k))
      else
        one = c_describe(x, cstr(what//': f'//achar(48 + k)), a(k))
      end if
    end function
  end subroutine

  subroutine store_put_int(store, step, tag, f1, f2, f3, f4, f5, f6, sent, status)
    type(fullshard_store), intent(in) :: store
    integer, intent(in) :: step, tag
    type(*), dimension(..), intent(in), target :: f1
    type(*), dimension(..), intent(in), target, optional :: f2, f3, f4, f5, f6
    logical, intent(out), optional :: sent
    integer, intent(out), optional :: status
    call store_put_int64(store, int(step, c_int64_t), int(tag, c_int64_t), f1, f2, f3, f4, f5, &
                         f6, sent, status)
  end subroutine

  !> Producer: one sample, f1 .. f6 the fields' arrays in their declared order (each of the
  !> field's Fortran shape and type; any section, used in place); step: the simulation's step,
  !> tag: the sample's position or id (both come back with a draw). sent: .false. when the
  !> sample was dropped (nonblocking delivery without credit, or a non-finite value with
  !> FULLSHARD_STORE_DROP). Not collective.
  subroutine store_put_int64(store, step, tag, f1, f2, f3, f4, f5, f6, sent, status)
    type(fullshard_store), intent(in) :: store
    integer(c_int64_t), intent(in) :: step, tag
    type(*), dimension(..), intent(in), target :: f1
    type(*), dimension(..), intent(in), target, optional :: f2, f3, f4, f5, f6
    logical, intent(out), optional :: sent
    integer, intent(out), optional :: status
    type(c_array) :: a(6)
    integer :: n
    integer(c_int) :: code, s
    s = 0
    call describe_fields('fullshard_store_put', .true., a, n, code, f1, f2, f3, f4, f5, f6)
    if (code == FULLSHARD_OK) &
      code = c_store_put_arrays(c_handle(store%id), step, tag, int(n, c_int), a, s)
    if (present(sent)) sent = s /= 0
    call finish(code, status)
  end subroutine

  !> Producer: no more puts from this rank (a second call does nothing). Not collective.
  subroutine fullshard_store_end_of_stream(store, status)
    type(fullshard_store), intent(in) :: store
    integer, intent(out), optional :: status
    call finish(c_store_end_of_stream(c_handle(store%id)), status)
  end subroutine

  !> Consumer: a batch of samples into f1 .. f6, the fields' arrays in their declared order,
  !> each of the field's Fortran shape plus the batch as its last dim (a(n1, n2, batch) for a
  !> field [n1, n2], a(batch) for a scalar one), of the stored type (real(c_float) for a
  !> store_as_f32 field); sections are filled in place. n: the samples drawn, the batch or
  !> fewer only once the stream ended (0: nothing left; the columns past n are left as they
  !> were). steps, ranks, tags (each at least the batch long): each drawn sample's step,
  !> producer rank and tag. A reservoir or window draw waits until the buffer holds
  !> min_samples and draws with replacement from them; a FIFO draw waits for its whole batch.
  !> Not collective.
  subroutine fullshard_store_draw(store, n, f1, f2, f3, f4, f5, f6, steps, ranks, tags, status)
    type(fullshard_store), intent(in) :: store
    integer, intent(out) :: n
    type(*), dimension(..), intent(inout), target :: f1
    type(*), dimension(..), intent(inout), target, optional :: f2, f3, f4, f5, f6
    integer(c_int64_t), intent(out), optional :: steps(:), tags(:)
    integer(c_int), intent(out), optional :: ranks(:)
    integer, intent(out), optional :: status
    type(c_array) :: a(6)
    integer :: k
    integer(c_int64_t) :: batch, drawn
    integer(c_int) :: code
    n = 0
    drawn = 0
    call describe_fields('fullshard_store_draw', .false., a, k, code, f1, f2, f3, f4, f5, f6)
    batch = 0
    if (code == FULLSHARD_OK) batch = a(1)%shape(1)  ! the last Fortran dim
    if (code == FULLSHARD_OK) code = meta_size('steps', present(steps))
    if (code == FULLSHARD_OK) code = meta_size('ranks', present(ranks))
    if (code == FULLSHARD_OK) code = meta_size('tags', present(tags))
    if (code == FULLSHARD_OK) &
      code = c_store_draw_arrays(c_handle(store%id), batch, int(k, c_int), a, steps, ranks, &
                                 tags, drawn)
    n = int(drawn)
    call finish(code, status)
  contains
    integer(c_int) function meta_size(name, given)
      character(*), intent(in) :: name
      logical, intent(in) :: given
      integer(c_int64_t) :: m
      meta_size = FULLSHARD_OK
      if (.not. given) return
      select case (name)
      case ('steps')
        m = size(steps)
      case ('ranks')
        m = size(ranks)
      case default
        m = size(tags)
      end select
      if (m < batch) meta_size = c_detail_fail(FULLSHARD_ERR_ARGUMENT, &
                                               cstr('fullshard_store_draw: '//name//' has '// &
                                                    int_text(m)//' elements for a batch of '// &
                                                    int_text(batch)))
    end function
  end subroutine

  !> ended: this consumer has every producer's end of stream and ingested everything they sent
  !> (its buffer may still hold samples to draw); a rank that is only a producer: its
  !> end_of_stream was called. Not collective.
  subroutine fullshard_store_ended(store, ended, status)
    type(fullshard_store), intent(in) :: store
    logical, intent(out) :: ended
    integer, intent(out), optional :: status
    integer(c_int) :: e, code
    e = 0
    code = c_store_ended(c_handle(store%id), e)
    ended = e /= 0
    call finish(code, status)
  end subroutine

  !> Receives what has arrived without waiting (a consumer that draws rarely). Not collective.
  subroutine fullshard_store_progress(store, status)
    type(fullshard_store), intent(in) :: store
    integer, intent(out), optional :: status
    call finish(c_store_progress(c_handle(store%id)), status)
  end subroutine

  !> This rank's counters. Not collective.
  subroutine fullshard_store_stats(store, stats, status)
    type(fullshard_store), intent(in) :: store
    type(fullshard_store_stats_info), intent(out) :: stats
    integer, intent(out), optional :: status
    call finish(c_store_stats(c_handle(store%id), stats), status)
  end subroutine

  !> The mean and standard deviation of `field` over every element this rank ingested. Not
  !> collective.
  subroutine fullshard_store_moments(store, field, moments, status)
    type(fullshard_store), intent(in) :: store
    character(*), intent(in) :: field
    type(fullshard_field_moments), intent(out) :: moments
    integer, intent(out), optional :: status
    call finish(c_store_moments(c_handle(store%id), cstr(field), moments), status)
  end subroutine

  !> The consumers' moments of `field` merged, the same on every rank. Collective.
  subroutine fullshard_store_global_moments(store, field, moments, status)
    type(fullshard_store), intent(in) :: store
    character(*), intent(in) :: field
    type(fullshard_field_moments), intent(out) :: moments
    integer, intent(out), optional :: status
    call finish(c_store_global_moments(c_handle(store%id), cstr(field), moments), status)
  end subroutine

  !> bytes: what this rank holds for the store; sample_bytes: one sample. Not collective.
  subroutine fullshard_store_bytes(store, bytes, sample_bytes, status)
    type(fullshard_store), intent(in) :: store
    integer(c_int64_t), intent(out) :: bytes
    integer(c_int64_t), intent(out), optional :: sample_bytes
    integer, intent(out), optional :: status
    integer(c_int64_t) :: one
    integer(c_int) :: code
    one = 0
    code = c_store_bytes(c_handle(store%id), bytes, one)
    if (present(sample_bytes)) sample_bytes = one
    call finish(code, status)
  end subroutine

  !> Ends the store's traffic (every rank's stream, the last acknowledgements): afterwards only
  !> stats, moments, ended, bytes and free. Collective.
  subroutine fullshard_store_close(store, status)
    type(fullshard_store), intent(in) :: store
    integer, intent(out), optional :: status
    call finish(c_store_close(c_handle(store%id)), status)
  end subroutine

  !> Frees the store and resets the handle (not collective, never waits: close it first).
  subroutine fullshard_store_free(store, status)
    type(fullshard_store), intent(inout) :: store
    integer, intent(out), optional :: status
    type(c_handle) :: h
    integer(c_int) :: code
    h%id = store%id
    code = c_store_free(h)
    store%id = h%id
    call finish(code, status)
  end subroutine

end module fullshard
