// Launch parameters and launchers of the four all-to-all kernels plus the benchmark helpers.
// Host code (FFI handlers) includes only this; the kernels live in the .cu files beside it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/error_record.h"
#include "core/layout.h"

namespace jmc {

struct Launch {
  int num_blocks;
  int warps_per_block;
};

// Per-call scratch in ordinary device memory, zero between calls (the kernels restore it).
struct LocalScratch {
  uint32_t* send_count;       // [world] tokens this rank sent to each rank
  uint32_t* expert_fill;      // [L] rows taken in each local expert
  uint32_t* blocks_done;      // [4] one ticket counter per kernel, for the last-block step
};

struct CommonParams {
  Shape shape;
  SymmetricLayout sym;
  LocalScratch scratch;
  ErrorRecord* error;  // device view of the pinned record
  int rank;
  uint64_t timeout_ns;
};

struct DispatchSendParams {
  CommonParams c;
  const uint8_t* x;        // [max_m, H] dispatch dtype
  const float* x_scale;    // [max_m, S] or nullptr
  const int32_t* indices;  // [max_m, k], repeated experts already -1
  const int32_t* num_tokens;
};

struct DispatchRecvParams {
  CommonParams c;
  uint8_t* expert_x;            // [L, R, H]
  float* expert_x_scale;        // [L, R, S] or nullptr
  int32_t* expert_num_tokens;   // [L]
  int32_t* row_source;          // [L, R] pack_source(...), rows < count
};

struct CombineSendParams {
  CommonParams c;
  const uint8_t* expert_y;             // [L, R, H] combine dtype
  const int32_t* expert_num_tokens;    // [L]
  const int32_t* row_source;           // [L, R]
};

struct CombineRecvParams {
  CommonParams c;
  const int32_t* indices;   // [max_m, k], repeated experts already -1
  const float* weights;     // [max_m, k], repeated experts' weights merged
  const int32_t* num_tokens;
  uint16_t* y;              // [max_m, H] bf16
};

struct BarrierParams {
  CommonParams c;
  uint64_t epoch;  // strictly increasing per handle
};

cudaError_t launch_dispatch_send(const DispatchSendParams& p, Launch l, cudaStream_t s);
cudaError_t launch_dispatch_recv(const DispatchRecvParams& p, Launch l, cudaStream_t s);
cudaError_t launch_combine_send(const CombineSendParams& p, Launch l, cudaStream_t s);
cudaError_t launch_combine_recv(const CombineRecvParams& p, Launch l, cudaStream_t s);
cudaError_t launch_barrier(const BarrierParams& p, cudaStream_t s);
cudaError_t launch_timestamp(uint64_t* out, cudaStream_t s);

}  // namespace jmc
