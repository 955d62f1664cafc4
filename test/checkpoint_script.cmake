# Shared start of the checkpoint CTest scripts (checkpoint_cli.cmake, checkpoint_kill.cmake):
#   set(SCRIPT <name>) set(REQUIRED <vars...>) include(checkpoint_script.cmake)
# checks that every required -D variable was given, sets DIR to a fresh directory under
# $TMPDIR or /tmp named after SCRIPT (the scripts remove it at the end), and defines
# fail(msg), which removes DIR before stopping with the message.
foreach(v IN LISTS REQUIRED)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "${CMAKE_SCRIPT_MODE_FILE} needs -D${v}=...")
  endif()
endforeach()
set(tmp "$ENV{TMPDIR}")
if(NOT tmp)
  set(tmp /tmp)
endif()
string(RANDOM LENGTH 10 suffix)
set(DIR "${tmp}/fullshard-${SCRIPT}-${suffix}")

function(fail msg)
  file(REMOVE_RECURSE "${DIR}")
  message(FATAL_ERROR "${msg}")
endfunction()
