// How our kernels start: programmatic dependent launch (Hopper and newer).
//
// Why: every kernel boundary of ours cost a 4-7 us launch gap (8 ranks under MPS on one GPU).
// A kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization may be scheduled
// while the kernel before it on the stream still runs, as soon as every block of that one has
// executed griddepcontrol.launch_dependents (or at its end if it never does); it then sits in
// griddepcontrol.wait, which returns once the earlier kernels have completed and their writes
// are visible. So every kernel of ours first waits (before it reads anything: inputs, epochs,
// flags) and then releases its own successor, which is resident and waiting by the time we
// end. Measured (cf3b416, JMC_PDL=0 as the A/B): dispatch_send end -> dispatch_recv start
// 4-6 us -> 0.6-2 us. It cannot help a launch the host has not made yet (the first kernel
// after a barrier at decode sizes, docs/notes.md). XLA launches its kernels without the
// attribute: for them, and for a kernel of ours behind one of theirs, this is an ordinary
// stream-ordered launch.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/kernels.h"

namespace jmc {

// First statement of every kernel of ours (a no-op when launched without the attribute).
__device__ __forceinline__ void wait_for_previous_kernels() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Launches `kernel` on l.num_blocks x l.warps_per_block warps, as a programmatic dependent of
// the previous kernel on the stream when l.dependent_launch is set (the handle sets it on
// Hopper and newer unless JMC_PDL=0).
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), Launch l, size_t shared_bytes,
                          cudaStream_t stream, const Args&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(l.num_blocks);
  config.blockDim = dim3(l.warps_per_block * 32);
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = l.dependent_launch ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

// Blocks per SM that fit for every instantiation of one body (kernels.h, PathBits): a grid
// sized by this fits whichever of them a handle launches.
template <typename Kernel, typename... Kernels>
int fewest_blocks_per_sm(int warps_per_block, size_t shared_bytes, Kernel kernel,
                         Kernels... others) {
  int blocks = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, warps_per_block * 32,
                                                shared_bytes);
  if constexpr (sizeof...(others) == 0) {
    return blocks;
  } else {
    return std::min(blocks, fewest_blocks_per_sm(warps_per_block, shared_bytes, others...));
  }
}

}  // namespace jmc
