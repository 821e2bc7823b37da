# Finds FlashInfer's kernel headers and prepares the copy this project compiles.
#
# The headers ship inside the flashinfer-python wheel (flashinfer/data/include). We
# never import flashinfer (its import pulls in torch and more); we look, in order, at
#   1. -DFLASHINFER_INCLUDE_DIR=... or the FLASHINFER_INCLUDE_DIR environment variable;
#   2. an installed flashinfer-python distribution, located through importlib.metadata;
#   3. third_party/flashinfer/include, filled by tools/fetch_flashinfer_headers.py
#      (downloads the pinned wheel with --no-deps and unpacks only these headers: the
#      route for JAX-only users who do not want flashinfer's heavy dependencies);
#   4. none of these: the build runs that script itself, unpacking into the build tree
#      (so `pip install .` is one step; offline it fails, saying what to do).
#
# The copy in the build tree marks six free functions of trtllm_allreduce_fusion.cuh
# (and of trtllm_moe_allreduce_fusion.cuh)
# `inline`: the header defines them non-inline, so two translation units including it
# fail to link with duplicate strong symbols. The patch checks that each definition
# appears exactly as expected, so a changed header fails the build loudly.
# The pinned version has one home: tools/fetch_flashinfer_headers.py.
set(FUSEDAR_FLASHINFER_FETCH_SCRIPT "${CMAKE_CURRENT_LIST_DIR}/../../tools/fetch_flashinfer_headers.py")
file(STRINGS "${FUSEDAR_FLASHINFER_FETCH_SCRIPT}" _fusedar_pin REGEX "^VERSION = \"[^\"]+\"$")
string(REGEX REPLACE "^VERSION = \"([^\"]+)\"$" "\\1" FUSEDAR_FLASHINFER_VERSION "${_fusedar_pin}")
if(NOT FUSEDAR_FLASHINFER_VERSION MATCHES "^[0-9]")
  message(FATAL_ERROR "jax_fusedar: no 'VERSION = \"...\"' line in ${FUSEDAR_FLASHINFER_FETCH_SCRIPT}")
endif()

function(_fusedar_find_flashinfer_include out_var)
  if(FLASHINFER_INCLUDE_DIR)
    set(${out_var} "${FLASHINFER_INCLUDE_DIR}" PARENT_SCOPE)
    return()
  endif()
  if(DEFINED ENV{FLASHINFER_INCLUDE_DIR})
    set(${out_var} "$ENV{FLASHINFER_INCLUDE_DIR}" PARENT_SCOPE)
    return()
  endif()
  find_package(Python COMPONENTS Interpreter QUIET)
  if(Python_EXECUTABLE)
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c
        "import importlib.metadata as m; d = m.distribution('flashinfer-python'); print(d.version); print(d.locate_file('flashinfer/data/include'))"
      OUTPUT_VARIABLE out RESULT_VARIABLE rc ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(rc EQUAL 0)
      string(REPLACE "\n" ";" lines "${out}")
      list(GET lines 0 version)
      list(GET lines 1 dir)
      if(EXISTS "${dir}/flashinfer/comm/trtllm_allreduce_fusion.cuh")
        if(NOT version STREQUAL FUSEDAR_FLASHINFER_VERSION)
          message(WARNING "jax_fusedar is tested with flashinfer-python ${FUSEDAR_FLASHINFER_VERSION}; "
                          "found ${version}")
        endif()
        set(${out_var} "${dir}" PARENT_SCOPE)
        return()
      endif()
    endif()
  endif()
  set(vendored "${PROJECT_SOURCE_DIR}/third_party/flashinfer/include")
  if(EXISTS "${vendored}/flashinfer/comm/trtllm_allreduce_fusion.cuh")
    set(${out_var} "${vendored}" PARENT_SCOPE)
    return()
  endif()
  # Fetch into the build tree, never the (possibly read-only) source tree; the script
  # keeps a VERSION marker there, so a re-configure of the same build does not download
  # again.
  set(fetched "${CMAKE_BINARY_DIR}/flashinfer_fetched")
  set(fetch_script "${FUSEDAR_FLASHINFER_FETCH_SCRIPT}")
  if(NOT Python_EXECUTABLE)
    message(FATAL_ERROR
      "jax_fusedar: FlashInfer's kernel headers were not found and cannot be fetched "
      "(no Python interpreter). Either\n"
      "  pip install --no-deps flashinfer-python==${FUSEDAR_FLASHINFER_VERSION}\n"
      "or set FLASHINFER_INCLUDE_DIR to a directory containing flashinfer/comm/.")
  endif()
  message(STATUS "jax_fusedar: fetching FlashInfer ${FUSEDAR_FLASHINFER_VERSION}'s headers "
                 "(the wheel, --no-deps) into ${fetched}")
  execute_process(
    COMMAND "${Python_EXECUTABLE}" "${fetch_script}" --dest "${fetched}"
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0 OR NOT EXISTS "${fetched}/include/flashinfer/comm/trtllm_allreduce_fusion.cuh")
    message(FATAL_ERROR "jax_fusedar: FlashInfer's kernel headers were not found, and "
                        "fetching them failed:\n${out}${err}")
  endif()
  set(${out_var} "${fetched}/include" PARENT_SCOPE)
endfunction()

function(_fusedar_patch text_var old new expected_count what)
  string(REPLACE "${old}" "@@FUSEDAR_PATCH@@" marked "${${text_var}}")
  string(REGEX MATCHALL "@@FUSEDAR_PATCH@@" hits "${marked}")
  list(LENGTH hits count)
  if(NOT count EQUAL expected_count)
    message(FATAL_ERROR "jax_fusedar: expected ${expected_count} definition(s) of ${what} in "
                        "${name}.cuh, found ${count}; the FlashInfer header "
                        "changed, update ffi/cmake/FlashInferHeaders.cmake")
  endif()
  string(REPLACE "@@FUSEDAR_PATCH@@" "${new}" patched "${marked}")
  set(${text_var} "${patched}" PARENT_SCOPE)
endfunction()

function(fusedar_prepare_flashinfer_headers out_include_dir)
  _fusedar_find_flashinfer_include(src)
  message(STATUS "jax_fusedar: FlashInfer headers from ${src}")
  set(dst "${CMAKE_BINARY_DIR}/flashinfer_patched")
  # The kernel header's whole include closure (logging.h is copied but its body is
  # skipped: FLASHINFER_LOGGING_H_ is pre-defined, see
  # ffi/kernels/flashinfer_kernel.cuh).
  foreach(rel exception.h fp4_layout.cuh logging.h utils.cuh vec_dtypes.cuh)
    configure_file("${src}/flashinfer/${rel}" "${dst}/flashinfer/${rel}" COPYONLY)
  endforeach()
  # The MoE header (patterns 6 and 7) defines the same six free functions.
  foreach(name trtllm_allreduce_fusion trtllm_moe_allreduce_fusion)
    set(header "${src}/flashinfer/comm/${name}.cuh")
    set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${header}")
    file(READ "${header}" text)
    _fusedar_patch(text "\nint get_sm_count() {" "\ninline int get_sm_count() {" 1 "get_sm_count()")
    _fusedar_patch(text "\nbool use_oneshot(int token_num) {"
                   "\ninline bool use_oneshot(int token_num) {" 1 "use_oneshot(int)")
    _fusedar_patch(text "template <>\n__device__ bool is_negative_zero<"
                   "template <>\n__device__ inline bool is_negative_zero<" 4
                   "is_negative_zero<> specialisations")
    set(patched "${dst}/flashinfer/comm/${name}.cuh")
    # Write through configure_file(COPYONLY) so an unchanged header keeps its timestamp
    # and a re-configure does not recompile every kernel.
    file(WRITE "${dst}/${name}.cuh.tmp" "${text}")
    configure_file("${dst}/${name}.cuh.tmp" "${patched}" COPYONLY)
  endforeach()
  set(${out_include_dir} "${dst}" PARENT_SCOPE)
endfunction()
