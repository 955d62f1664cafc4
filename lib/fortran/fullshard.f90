! The Fortran module of fullshard (`use fullshard`): sharded training of a LibTorch model from
! a Fortran simulation, over the C API (include/fullshard/fullshard.h).
!
! - Communicators: mpi_f08's type(MPI_Comm) or an integer handle (MPI_Comm_f2c underneath).
! - Arrays: any rank, real(c_float) / real(c_double) / integer(c_int32_t) / integer(c_int64_t),
!   sections included (used in place, no copy). Column-major: the Fortran array x(f, n) is the
!   LibTorch tensor of shape (n, f), so put the samples (batch) in the LAST dimension and the
!   features in the first: x(features, samples), field(nx, ny, channels, samples).
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

end module fullshard
