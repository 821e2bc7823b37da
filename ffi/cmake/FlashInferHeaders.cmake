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
# Two copies go into the build tree. Both mark six free functions of
# trtllm_allreduce_fusion.cuh `inline` (the header defines them non-inline, so two
# translation units including it fail to link with duplicate strong symbols).
#  - flashinfer_unhooked: nothing else. The build compiles the kernels from it only to
#    read their register counts (ffi/core/CMakeLists.txt, tools/launch_registers.py):
#    FlashInfer's own build compiles exactly this code.
#  - flashinfer_patched, the copy the library is built from: also bounds every wait loop
#    of the kernel (ffi/core/watchdog.h) and keeps FlashInfer's launch geometry although
#    the bounded waits change the kernels' register counts (see "Launch geometry" below).
# trtllm_moe_allreduce_fusion.cuh (patterns 6, 7) defines the same free functions and goes
# into both copies with the same `inline` marks; in flashinfer_patched its wait loops are
# bounded too and its kernels held to the unhooked kernels' registers (its launchers read no
# register count, so nothing else is pinned).
# Each patch checks that its text appears exactly as often as expected, so a changed
# header fails the build loudly.
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
        set(${out_var}_VERSION "${version}" PARENT_SCOPE)
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

# Both headers define get_sm_count(), use_oneshot() and four is_negative_zero<>
# specialisations non-inline: marked `inline` so that several translation units link.
function(_fusedar_mark_inline text_var)
  set(text "${${text_var}}")
  _fusedar_patch(text "\nint get_sm_count() {" "\ninline int get_sm_count() {" 1 "get_sm_count()")
  _fusedar_patch(text "\nbool use_oneshot(int token_num) {"
                 "\ninline bool use_oneshot(int token_num) {" 1 "use_oneshot(int)")
  _fusedar_patch(text "template <>\n__device__ bool is_negative_zero<"
                 "template <>\n__device__ inline bool is_negative_zero<" 4
                 "is_negative_zero<> specialisations")
  set(${text_var} "${text}" PARENT_SCOPE)
endfunction()

# Writes `text` as dir/flashinfer/comm/trtllm_allreduce_fusion.cuh next to a copy of the
# header's whole include closure (logging.h is copied but its body is skipped:
# FLASHINFER_LOGGING_H_ is pre-defined, see ffi/kernels/flashinfer_kernel.cuh).
function(_fusedar_write_header_tree src dst text)
  foreach(rel exception.h fp4_layout.cuh logging.h utils.cuh vec_dtypes.cuh)
    configure_file("${src}/flashinfer/${rel}" "${dst}/flashinfer/${rel}" COPYONLY)
  endforeach()
  # Written through configure_file(COPYONLY) so an unchanged header keeps its timestamp
  # and a re-configure does not recompile every kernel.
  file(WRITE "${dst}/trtllm_allreduce_fusion.cuh.tmp" "${text}")
  configure_file("${dst}/trtllm_allreduce_fusion.cuh.tmp"
                 "${dst}/flashinfer/comm/trtllm_allreduce_fusion.cuh" COPYONLY)
endfunction()

# The MoE header (patterns 6 and 7) defines the same free functions non-inline; it gets the
# same three `inline` patches and goes into both trees. With `hooked` (flashinfer_patched)
# its wait loops are bounded as the dense kernel's are (ffi/kernels/wait_hooks.cuh, included
# first by ffi/kernels/flashinfer_moe_kernel.cuh): both kernels' Lamport polls and the grid
# counter of LamportComm::update (their only spin loops; rms_norm's cluster.sync() is a
# hardware barrier of this rank's co-scheduled blocks). The loops' conditions and the data
# they read are unchanged. Unlike the dense launcher, the MoE launchers size nothing from a
# register count: the block size follows hidden_dim, and the cluster size is
# min(8, cudaOccupancyMaxPotentialClusterSize(kernel, 128 threads)), which no register count
# a kernel can have (at most 255 x 128 threads, half an SM's registers) lowers below 8. So the
# hooked MoE kernels launch with FlashInfer's geometry; only their register allocation is
# capped at the unhooked one's, so that every block FlashInfer's build launches fits.
function(_fusedar_write_moe_header src dst hooked)
  set(name trtllm_moe_allreduce_fusion)  # named in _fusedar_patch's errors
  set(header "${src}/flashinfer/comm/${name}.cuh")
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${header}")
  file(READ "${header}" text)
  _fusedar_mark_inline(text)
  # A race in FlashInfer's pattern 7 (both trees: a fix, not a hook). Its Lamport poll reads
  # slot r of rank r's own buffer over NVLink, where every other kernel (pattern 6, the dense
  # one-shot) reads slot r of this rank's buffer. The values are the same (each rank writes its
  # rows into every rank's buffer, its own included), but rank r, once it has every peer's rows
  # of call N, may start call N+1 and clear its call-N buffer while this rank still polls it:
  # this rank then waits forever for data that was wiped. Back-to-back calls hang (64 calls
  # at 1024 tokens x 7168, tests/gpu/moe_gpu.py; FlashInfer's own build too). Reading this
  # rank's buffer, which only this rank clears, after it is done with it, gives the same bits.
  _fusedar_patch(text "        // LDG.128 from local rank\n        vals[r].load_global_volatile(reinterpret_cast<T*>(comm.data_bufs[r]) +"
                 "        // LDG.128 from local rank\n        vals[r].load_global_volatile(reinterpret_cast<T*>(comm.data_bufs[params.rank]) +"
                 1 "pattern 7's Lamport poll (the peer-buffer race)")
  if(hooked)
    #  - LamportComm's constructor: block 0 counts the call (the call number in the record);
    _fusedar_patch(text "    if (threadIdx.x == 0) {\n      atomicAdd(counter_ptr, 1);\n    }"
                   "    if (threadIdx.x == 0) {\n      atomicAdd(counter_ptr, 1);\n      ::fusedar_wait::count_call(counter_ptr);\n    }"
                   1 "LamportComm's counter increment")
    #  - LamportComm::update: the grid-counter wait, given the call's context (both kernels);
    _fusedar_patch(text "  __device__ __forceinline__ void update(int new_clear_size) {"
                   "  template <class FusedarCtx>\n  __device__ __forceinline__ void update(int new_clear_size, FusedarCtx const& fusedar_ctx) {"
                   1 "LamportComm::update")
    _fusedar_patch(text "      while (*reinterpret_cast<int volatile*>(counter_ptr) != gridDim.x) {\n      }"
                   "      ::fusedar_wait::spin(fusedar_ctx, ::fusedar::watchdog::kGrid, -1, int(gridDim.x), [&] {\n        return *reinterpret_cast<int volatile*>(counter_ptr) != gridDim.x;\n      });"
                   1 "the grid-counter wait loop")
    _fusedar_patch(text "  comm.update(params.size * NRanks);"
                   "  comm.update(params.size * NRanks, FUSEDAR_MOE_WAIT_CTX);" 2
                   "the two kernels' comm.update")
    #  - the Lamport polls of both kernels: the missing peer is the one whose slot (in this
    #    rank's buffer) still holds -0.0.
    _fusedar_patch(text "    bool done = false;\n" "    bool done = false;\n    FUSEDAR_WAIT_STATE\n" 2
                   "the Lamport polls' state")
    _fusedar_patch(text "        done &= !has_neg_zero<T, VEC_SIZE>(vals[r]);\n      }\n    }\n"
                   "        done &= !has_neg_zero<T, VEC_SIZE>(vals[r]);\n      }\n      FUSEDAR_MOE_WAIT_LAMPORT_TICK\n    }\n"
                   2 "the Lamport poll loops")
    #  - registers: each hooked kernel is held to the unhooked one's allocation
    #    (ffi/kernels/moe_launch_registers.cuh), so it launches wherever FlashInfer's does.
    _fusedar_patch(text "__global__ void moereduce_allreduce_fusion_kernel_oneshot_lamport("
                   "__global__ void __maxnreg__((::fusedar_geometry::moe_register_cap<::fusedar_geometry::kMoeReduction, T, NRanks, (AllReduceOut ? 8 : 0) | (ResidualOut ? 4 : 0) | (NormOut ? 2 : 0) | (QuantOut ? 1 : 0)>())) moereduce_allreduce_fusion_kernel_oneshot_lamport("
                   1 "the MoE reduction kernel")
    _fusedar_patch(text "__global__ void moefinalize_allreduce_fusion_kernel_oneshot_lamport("
                   "__global__ void __maxnreg__((::fusedar_geometry::moe_register_cap<::fusedar_geometry::kMoeFinalize, T, NRanks, (ResidualOut ? 4 : 0) | (NormOut ? 2 : 0) | (QuantOut ? 1 : 0)>())) moefinalize_allreduce_fusion_kernel_oneshot_lamport("
                   1 "the MoE finalize kernel")
  endif()
  file(WRITE "${dst}/${name}.cuh.tmp" "${text}")
  configure_file("${dst}/${name}.cuh.tmp" "${dst}/flashinfer/comm/${name}.cuh" COPYONLY)
endfunction()

function(fusedar_prepare_flashinfer_headers out_include_dir out_unhooked_include_dir)
  set(name trtllm_allreduce_fusion)  # named in _fusedar_patch's errors
  _fusedar_find_flashinfer_include(src)
  message(STATUS "jax_fusedar: FlashInfer headers from ${src}")
  # Their version, for the build record (ffi/core/CMakeLists.txt): the installed
  # distribution's, or the VERSION marker tools/fetch_flashinfer_headers.py leaves next to
  # the include folder it fills (vendored or fetched); else unknown (FLASHINFER_INCLUDE_DIR).
  if(NOT src_VERSION AND EXISTS "${src}/../VERSION")
    file(STRINGS "${src}/../VERSION" src_VERSION LIMIT_COUNT 1)
  endif()
  set(FUSEDAR_FLASHINFER_HEADERS_DIR "${src}" PARENT_SCOPE)
  set(FUSEDAR_FLASHINFER_HEADERS_VERSION "${src_VERSION}" PARENT_SCOPE)
  set(dst "${CMAKE_BINARY_DIR}/flashinfer_patched")
  set(dst_unhooked "${CMAKE_BINARY_DIR}/flashinfer_unhooked")
  set(header "${src}/flashinfer/comm/trtllm_allreduce_fusion.cuh")
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${header}")
  file(READ "${header}" text)
  _fusedar_mark_inline(text)
  _fusedar_write_header_tree("${src}" "${dst_unhooked}" "${text}")
  _fusedar_write_moe_header("${src}" "${dst_unhooked}" FALSE)
  # Bounded waits (ffi/core/watchdog.h, ffi/kernels/wait_hooks.cuh, included first): every
  # wait loop of the kernel reads the clock every so many spins and traps past the
  # workspace's timeout. The loops' conditions and the data they read are unchanged.
  #  - comm constructors: block 0 counts the call (the call number in the failure record);
  _fusedar_patch(text "    if (threadIdx.x == 0) {\n      atomicAdd(counter_ptr, 1);\n    }"
                 "    if (threadIdx.x == 0) {\n      atomicAdd(counter_ptr, 1);\n      ::fusedar_wait::count_call(counter_ptr);\n    }"
                 2 "the comm constructors' counter increment")
  #  - SyncComm/LamportComm::update: the grid-counter wait, given the call's context;
  _fusedar_patch(text "  __device__ __forceinline__ void update(int new_flag_value) {"
                 "  template <class FusedarCtx>\n  __device__ __forceinline__ void update(int new_flag_value, FusedarCtx const& fusedar_ctx) {"
                 1 "SyncComm::update")
  _fusedar_patch(text "  __device__ __forceinline__ void update(int new_clear_size) {"
                 "  template <class FusedarCtx>\n  __device__ __forceinline__ void update(int new_clear_size, FusedarCtx const& fusedar_ctx) {"
                 1 "LamportComm::update")
  _fusedar_patch(text "      while (*reinterpret_cast<int volatile*>(counter_ptr) != gridDim.x) {\n      }"
                 "      ::fusedar_wait::spin(fusedar_ctx, ::fusedar::watchdog::kGrid, -1, int(gridDim.x), [&] {\n        return *reinterpret_cast<int volatile*>(counter_ptr) != gridDim.x;\n      });"
                 2 "the grid-counter wait loops")
  _fusedar_patch(text "  comm.update(params.size * NRanks);"
                 "  comm.update(params.size * NRanks, FUSEDAR_WAIT_CTX(true));" 1
                 "the one-shot kernel's comm.update")
  _fusedar_patch(text "  comm.update(barrier.m_flag_value);"
                 "  comm.update(barrier.m_flag_value, FUSEDAR_WAIT_CTX(false));" 1
                 "the two-shot kernel's comm.update")
  #  - Barrier::sync: thread t < NRanks waits for rank t's flag;
  _fusedar_patch(text "  __device__ __forceinline__ void sync() {"
                 "  template <class FusedarCtx>\n  __device__ __forceinline__ void sync(FusedarCtx const& fusedar_ctx) {"
                 1 "Barrier::sync")
  _fusedar_patch(text "      while (ld_flag(m_current_flag) == prev_flag(m_flag_value)) {\n      }"
                 "      ::fusedar_wait::spin(fusedar_ctx, ::fusedar::watchdog::kBarrier, int(threadIdx.x), int(blockIdx.x), [&] {\n        return ld_flag(m_current_flag) == prev_flag(m_flag_value);\n      });"
                 1 "the barrier wait loop")
  _fusedar_patch(text "  barrier.sync();" "  barrier.sync(FUSEDAR_WAIT_CTX(false));" 2
                 "the two-shot kernel's barrier.sync calls")
  #  - the one-shot Lamport poll: the missing peer is the one whose slot still holds -0.0.
  _fusedar_patch(text "    bool done = false;\n" "    bool done = false;\n    FUSEDAR_WAIT_STATE\n" 1
                 "the Lamport poll's state")
  _fusedar_patch(text "        done &= !has_neg_zero<T, VEC_SIZE>(vals[r]);\n      }\n    }\n"
                 "        done &= !has_neg_zero<T, VEC_SIZE>(vals[r]);\n      }\n      FUSEDAR_WAIT_LAMPORT_TICK\n    }\n"
                 1 "the Lamport poll loop")
  # Launch geometry (ffi/kernels/launch_registers.cuh). FlashInfer's launcher sizes blocks
  # and clusters from the kernel's register count (max threads per block = 65536 / regs),
  # and the block/cluster split decides the order of RMSNorm's sum of squares, so the
  # hooked kernels, whose counts differ by a few registers, must launch as the unhooked
  # ones would: the launcher reads the unhooked kernels' counts (measured by the build)
  # instead of asking the runtime, and each hooked kernel is held to the unhooked one's
  # register allocation, so that every block size FlashInfer picks still fits.
  _fusedar_patch(text "          bool TriggerCompletionAtEnd = true>\n__global__ void allreduce_fusion_kernel_oneshot_lamport("
                 "          bool TriggerCompletionAtEnd = true>\n__global__ void __maxnreg__((::fusedar_geometry::register_cap<TriggerCompletionAtEnd ? ::fusedar_geometry::kOneShotTrigger : ::fusedar_geometry::kOneShotNoTrigger, Pattern, T, NRanks, Fp32Acc>())) allreduce_fusion_kernel_oneshot_lamport("
                 1 "the one-shot kernel")
  _fusedar_patch(text "__global__ void allreduce_fusion_kernel_twoshot_sync("
                 "__global__ void __maxnreg__((::fusedar_geometry::register_cap<::fusedar_geometry::kTwoShot, Pattern, T, NRanks, Fp32Acc>())) allreduce_fusion_kernel_twoshot_sync("
                 1 "the two-shot kernel")
  _fusedar_patch(text "      allreduce_fusion_kernel_oneshot_lamport<Pattern, T, NRanks, Fp32Acc, TriggerCompletionAtEnd>;\n  cudaFuncAttributes attr;\n  cudaFuncGetAttributes(&attr, kernel);\n  return attr.numRegs;"
                 "      allreduce_fusion_kernel_oneshot_lamport<Pattern, T, NRanks, Fp32Acc, TriggerCompletionAtEnd>;\n  return ::fusedar_geometry::registers_for_geometry<TriggerCompletionAtEnd ? ::fusedar_geometry::kOneShotTrigger : ::fusedar_geometry::kOneShotNoTrigger, Pattern, T, NRanks, Fp32Acc>(reinterpret_cast<const void*>(kernel));"
                 1 "get_registers_per_thread_oneshot()")
  _fusedar_patch(text "  auto kernel = allreduce_fusion_kernel_twoshot_sync<Pattern, T, NRanks, Fp32Acc>;\n  cudaFuncAttributes attr;\n  cudaFuncGetAttributes(&attr, kernel);\n  return attr.numRegs;"
                 "  auto kernel = allreduce_fusion_kernel_twoshot_sync<Pattern, T, NRanks, Fp32Acc>;\n  return ::fusedar_geometry::registers_for_geometry<::fusedar_geometry::kTwoShot, Pattern, T, NRanks, Fp32Acc>(reinterpret_cast<const void*>(kernel));"
                 1 "get_registers_per_thread_twoshot()")
  _fusedar_write_header_tree("${src}" "${dst}" "${text}")
  _fusedar_write_moe_header("${src}" "${dst}" TRUE)
  set(${out_include_dir} "${dst}" PARENT_SCOPE)
  set(${out_unhooked_include_dir} "${dst_unhooked}" PARENT_SCOPE)
endfunction()
