// The world sizes the kernels are instantiated for, as the build passes them to the two
// launch sources (FUSEDAR_WORLD_SIZE_LIST, from SUPPORTED_WORLD_SIZES in
// jax_fusedar/common/limits.py: the one table, ffi/core/CMakeLists.txt), and the dispatch of
// a call to the instantiation of its world size. Core-private: the kernel translation units
// never include it. (nvcc splits a -D value at its commas, so the CUDA sources take the list
// through supported_world_size, defined in launch.cpp.)
#ifndef FUSEDAR_CORE_WORLD_SIZES_H_
#define FUSEDAR_CORE_WORLD_SIZES_H_

#include <string>
#include <utility>

namespace fusedar {

// Whether the kernels are built for `n` ranks; the list as "2, 4, 8 or 16".
bool supported_world_size(int n);
std::string world_sizes_text();

#ifdef FUSEDAR_WORLD_SIZE_LIST
using WorldSizes = std::integer_sequence<int, FUSEDAR_WORLD_SIZE_LIST>;

// launch(std::integral_constant<int, N>) for the call's world size `n`, or the error text of
// an unsupported one.
template <typename Launch, int... Ns>
std::string dispatch_world_size(int n, Launch&& launch, std::integer_sequence<int, Ns...>) {
  std::string out = "unsupported world size " + std::to_string(n);
  (void)((n == Ns ? (out = launch(std::integral_constant<int, Ns>{}), true) : false) || ...);
  return out;
}
#endif

}  // namespace fusedar

#endif  // FUSEDAR_CORE_WORLD_SIZES_H_
