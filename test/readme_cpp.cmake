# Every C++ block of README.md and of the documentation (docs/*.md, docs/guide/*.md), compiled
# (and below, their C and Fortran snippets):
# the examples must compile from the umbrella header. Included from test/CMakeLists.txt: sets _fs_docs (the
# pages' text, for the marked examples built there) and writes one source per block into
# the build directory and adds the object library test-readme-cpp (part of the default build,
# so a README example that does not compile fails the build). Blocks with their own main() are
# compiled as they are; the others (snippets) become the body of a function, with their
# #include lines moved to the top, and with the names they use from the surrounding text
# (rt, model, adamw, step, loss, rng_bytes, dir, optimizer, mesh, ...) declared extern.
# LibTorch blocks are left to torch.readme.
file(GLOB _fs_doc_pages CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/docs/*.md
                                          ${PROJECT_SOURCE_DIR}/docs/guide/*.md)
list(SORT _fs_doc_pages)
set(_fs_docs "")
foreach(_page ${PROJECT_SOURCE_DIR}/README.md ${_fs_doc_pages})
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${_page})
  file(READ ${_page} _text)
  string(APPEND _fs_docs "${_text}\n")
endforeach()
string(REPLACE ";" "@SEMICOLON@" _readme "${_fs_docs}")
# The fenced blocks of language `lang` in the pages, without their fences, as a list (their
# semicolons escaped as @SEMICOLON@).
function(fs_fenced_blocks lang out)
  string(REGEX MATCHALL "```${lang}\n[^`]*```" _found "${_readme}")
  set(_list)
  foreach(_b IN LISTS _found)
    string(REGEX REPLACE "^```${lang}\n" "" _b "${_b}")
    string(REGEX REPLACE "```$" "" _b "${_b}")
    list(APPEND _list "${_b}")
  endforeach()
  set(${out} "${_list}" PARENT_SCOPE)
endfunction()
fs_fenced_blocks(cpp _blocks)
set(_sources)
set(_n 0)
foreach(_block IN LISTS _blocks)
  string(REPLACE "@SEMICOLON@" ";" _block "${_block}")
  if(_block MATCHES "#include <torch/")
    continue()
  endif()
  math(EXPR _n "${_n} + 1")
  if(_block MATCHES "int main\\(")
    set(_source "// README.md and docs, C++ block ${_n} (a whole program)\n${_block}")
  else()
    string(REGEX MATCHALL "#include [^\n]*\n" _includes "${_block}")
    string(REGEX REPLACE "#include [^\n]*\n" "" _body "${_block}")
    string(REPLACE ";" "" _includes "${_includes}")
    set(_source "// README.md and docs, C++ block ${_n} (a snippet, in a function)
#pragma GCC diagnostic ignored \"-Wunused-variable\"
#pragma GCC diagnostic ignored \"-Wunused-but-set-variable\"
#pragma GCC diagnostic ignored \"-Wunused-parameter\"
#include <fullshard/fullshard.hpp>
${_includes}
#include <cstdint>
#include <memory>
#include <string>
namespace readme_context {
extern fullshard::Runtime& rt;
extern std::unique_ptr<fullshard::graph::Module> model;
extern fullshard::optim::AdamW adamw;
extern std::int64_t step;
extern double loss;
extern std::string rng_bytes;
// The pages' other names (docs/checkpoint-format.md, compression.md, memory.md).
extern std::string dir;
extern fullshard::optim::AdamW optimizer;
extern bool resuming;
extern std::int64_t first_step;
extern int steps, every, world;
void train_step();
extern fullshard::DeviceMesh mesh;
extern fullshard::graph::Module& root;
extern fullshard::graph::Module& layer;
extern fullshard::schedule::PlanOptions options;
extern std::size_t my_activation_bytes;
}  // namespace readme_context
namespace fs = fullshard;
using namespace readme_context;
void readme_block_${_n}() {
${_body}}
")
  endif()
  set(_file ${CMAKE_CURRENT_BINARY_DIR}/readme_cpp/block_${_n}.cpp)
  file(WRITE ${_file}.tmp "${_source}")
  configure_file(${_file}.tmp ${_file} COPYONLY)
  list(APPEND _sources ${_file})
endforeach()
if(_n LESS 3)
  message(FATAL_ERROR "README.md, docs/guide: found ${_n} C++ blocks to compile, expected at least 3")
endif()
add_library(test-readme-cpp OBJECT ${_sources})
target_link_libraries(test-readme-cpp PRIVATE fullshard::fullshard fullshard_warnings)

# The C snippets of the pages (```c blocks without main(); the whole programs are built by
# install.capi_consumer), each the body of a function over the names the pages use.
if(TARGET fullshard_c AND CMAKE_C_COMPILER_LOADED)
  fs_fenced_blocks(c _c_blocks)
  set(_c_sources)
  set(_c_n 0)
  foreach(_block IN LISTS _c_blocks)
    string(REPLACE "@SEMICOLON@" ";" _block "${_block}")
    if(_block MATCHES "int main\\(")
      continue()
    endif()
    math(EXPR _c_n "${_c_n} + 1")
    set(_file ${CMAKE_CURRENT_BINARY_DIR}/readme_c/block_${_c_n}.c)
    file(WRITE ${_file}.tmp "/* docs, C block ${_c_n} (a snippet, in a function) */
#include <fullshard/fullshard.h>
extern fullshard_model model;
extern fullshard_array in, tg;
extern double loss;
extern int steps;
/* docs/guide/in-situ.md's sample store: a solver's fields u[ny][nx], du and a cell (i, j). */
extern const double *u, *du;
extern int64_t nx, i, j, step;
void readme_c_block_${_c_n}(void) {
${_block}}
")
    configure_file(${_file}.tmp ${_file} COPYONLY)
    list(APPEND _c_sources ${_file})
  endforeach()
  if(_c_sources)
    add_library(test-readme-c OBJECT ${_c_sources})
    target_link_libraries(test-readme-c PRIVATE fullshard::c)
    set_target_properties(test-readme-c PROPERTIES C_STANDARD 99 C_STANDARD_REQUIRED ON)
    target_compile_options(test-readme-c PRIVATE -Wall -Wextra -Werror)
  endif()
endif()

# The Fortran snippets of the pages (```fortran blocks without a program statement; the README's
# whole program is built by install.capi_consumer), each the body of a subroutine over the
# names the pages use (a solver's fields u and du, a cell (i, j) and its id c; n: the samples a
# draw returned).
if(TARGET fullshard_fortran)
  fs_fenced_blocks(fortran _f_blocks)
  set(_f_sources)
  set(_f_n 0)
  foreach(_block IN LISTS _f_blocks)
    string(REPLACE "@SEMICOLON@" ";" _block "${_block}")
    if(_block MATCHES "(^|\n) *program ")
      continue()
    endif()
    math(EXPR _f_n "${_f_n} + 1")
    set(_file ${CMAKE_CURRENT_BINARY_DIR}/readme_fortran/block_${_f_n}.f90)
    file(WRITE ${_file}.tmp "! docs, Fortran block ${_f_n} (a snippet, in a subroutine)
subroutine readme_fortran_block_${_f_n}(u, du, i, j, c, nsteps)
  use mpi_f08
  use iso_c_binding
  use fullshard
  implicit none
  real(8), intent(in) :: u(:, :), du(:, :)
  integer, intent(in) :: i, j, c, nsteps
  integer :: step, n
${_block}end subroutine
")
    configure_file(${_file}.tmp ${_file} COPYONLY)
    list(APPEND _f_sources ${_file})
  endforeach()
  if(_f_n LESS 1)
    message(FATAL_ERROR "docs/guide: found no Fortran snippet to compile, expected the in-situ one")
  endif()
  add_library(test-readme-fortran OBJECT ${_f_sources})
  target_link_libraries(test-readme-fortran PRIVATE fullshard::fortran)
  target_compile_options(test-readme-fortran PRIVATE -std=f2018 -Wall -Werror
                                                     -Wno-unused-dummy-argument)
endif()
