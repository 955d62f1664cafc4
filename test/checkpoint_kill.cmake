# A writer killed at every point of the save protocol leaves the previous checkpoint loadable.
# Run by CTest as: cmake -DMPIEXEC=... -DNP=2 -DPROBE=... -P checkpoint_kill.cmake (in a fresh
# directory under $TMPDIR or /tmp, removed at the end, also on failure)
#   1. save step 10 (clean);
#   2. for each fault point: save step 20 with FULLSHARD_CKPT_FAULT=<point> (the writer must die
#      with the fault message), then load: step 10 with step 10's values;
#   3. save step 20 cleanly over the leftovers, load: step 20;
#   4. rank 0 saves while the other ranks never join: the job aborts after FULLSHARD_TIMEOUT.
set(SCRIPT ckpt-kill)
set(REQUIRED MPIEXEC NP PROBE)
include(${CMAKE_CURRENT_LIST_DIR}/checkpoint_script.cmake)

function(probe expect_ok)
  execute_process(COMMAND "${MPIEXEC}" -n ${NP} "${PROBE}" ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  set(out "${out}" PARENT_SCOPE)
  set(err "${err}" PARENT_SCOPE)
  if(expect_ok AND NOT rc EQUAL 0)
    fail("probe ${ARGN} failed (${rc}):\n${out}\n${err}")
  endif()
  if(NOT expect_ok AND rc EQUAL 0)
    fail("probe ${ARGN} should have died:\n${out}\n${err}")
  endif()
endfunction()

probe(TRUE write "${DIR}" 10)
foreach(fault mid_shard after_shards mid_index after_index before_latest mid_latest
              mid_shard@1 "mid_shard|full")
  string(REPLACE "|" ";" parts "${fault}")
  list(GET parts 0 point)
  set(kind "")
  list(LENGTH parts n)
  if(n GREATER 1)
    list(GET parts 1 kind)
  endif()
  set(ENV{FULLSHARD_CKPT_FAULT} "${point}")
  probe(FALSE write "${DIR}" 20 ${kind})
  unset(ENV{FULLSHARD_CKPT_FAULT})
  string(REGEX REPLACE "@.*" "" bare "${point}")
  if(NOT err MATCHES "FULLSHARD_CKPT_FAULT=${bare}: exiting in the middle of a checkpoint save")
    fail("fault ${fault}: no fault message:\n${out}\n${err}")
  endif()
  probe(TRUE check "${DIR}" 10)
  if(NOT out MATCHES "loaded step 10 from [^\n]*step-00000010: ok")
    fail("after fault ${fault}: ${out}")
  endif()
  message(STATUS "killed at ${fault}: step 10 still loads")
endforeach()
probe(TRUE write "${DIR}" 20)
probe(TRUE check "${DIR}" 20)
if(NOT out MATCHES "loaded step 20 from [^\n]*step-00000020[.0-9]*: ok")
  fail("after a clean save of step 20: ${out}")
endif()
file(GLOB leftovers "${DIR}/.tmp-*" "${DIR}/latest.tmp")
if(leftovers)
  fail("a clean save left temporary files: ${leftovers}")
endif()
# A rank that never joins a save: rank 0 aborts the job after FULLSHARD_TIMEOUT, naming the
# operation and the checkpoint, instead of waiting forever.
set(ENV{FULLSHARD_TIMEOUT} 1)
probe(FALSE stall "${DIR}/stalled" 30)
set(ENV{FULLSHARD_TIMEOUT} 60)
if(NOT err MATCHES "fullshard\\[rank 0\\]: MPI_Comm_idup on checkpoint save of '[^']*/stalled' \\(rank 0/${NP}, seq 1\\) did not finish within FULLSHARD_TIMEOUT=1 s; another rank is not taking part")
  fail("a save without the other ranks did not time out as expected:\n${out}\n${err}")
endif()
message(STATUS "a save that another rank never joins: aborted after FULLSHARD_TIMEOUT")
file(REMOVE_RECURSE "${DIR}")
message("checkpoint kill test: the previous checkpoint survived every fault")
