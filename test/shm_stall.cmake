# Runs shm_stall on NP ranks and checks that every rank printed the shared-memory timeout
# message naming the operation. -DMPIEXEC=... -DNP=... -DPROGRAM=...
execute_process(COMMAND ${MPIEXEC} -n ${NP} ${PROGRAM} OUTPUT_VARIABLE out ERROR_VARIABLE err
                RESULT_VARIABLE rc TIMEOUT 60)
set(all "${out}${err}")
math(EXPR last "${NP} - 1")
foreach(r RANGE 0 ${last})
  if(NOT all MATCHES "fullshard\\[rank ${r}\\]: all_gather[^\n]* on shared memory of communicator 'mesh\\(dp\\)\\.dp' \\(rank ${r}/${NP}, seq [0-9]+, [^\n]*waiting for rank [0-9]+\\) did not finish within FULLSHARD_TIMEOUT=[0-9.]+ s")
    message(FATAL_ERROR "rank ${r} did not report the timeout (exit ${rc}):\n${all}")
  endif()
endforeach()
if(NOT all MATCHES "every rank reported the timeout" OR NOT rc EQUAL 0)
  message(FATAL_ERROR "not every rank caught the timeout (exit ${rc}):\n${all}")
endif()
message(STATUS "${all}")
