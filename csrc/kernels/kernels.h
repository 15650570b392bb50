// Launch parameters and launchers of the four all-to-all kernels plus the benchmark helpers.
// Host code (FFI handlers) includes only this; the kernels live in the .cu files beside it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "core/error_record.h"
#include "core/layout.h"

namespace jmc {

// Threads per block the kernels are compiled for (__launch_bounds__): 16 warps, and at least
// two such blocks per SM (<= 64 registers): with one block (the 70-80 registers they took
// unbounded) too few warps are copying at large batches. At that cap (nvcc 13.0, sm_90) the
// split kernels spill a few words (dispatch_recv 44-48 B, the general bf16 combine_recv 28 B;
// -Xptxas -v); the fused one-block kernels have no cap and no spills.
constexpr int kMaxWarpsPerBlock = 16;
constexpr int kMinBlocksPerSm = 2;

struct Launch {
  int num_blocks;
  int warps_per_block;
  // Launched as a programmatic dependent of the previous kernel on the stream (core/launch.cuh).
  bool dependent_launch = false;
};

// Which kernel: indexes epochs, tickets, launches and timing slots.
enum KernelId : int {
  kDispatchSendKernel = 0,
  kDispatchRecvKernel = 1,
  kCombineSendKernel = 2,
  kCombineRecvKernel = 3,
};
constexpr int kNumKernels = 4;
static_assert(kNumKernels == kStartedKernels, "layout.h marks every kernel's start");

// Benchmark stamps (%globaltimer ns; one GPU clock, so comparable across ranks on one GPU).
// Per kernel: start and end (first and last block), then two marks of block 0: its waits for
// peers are over ("waited") and its share of the work is done ("worked"); then the end of
// the barrier kernel. The phases they bound are what benchmarks/bench_all_to_all.py --phases
// reports.
enum Mark : int { kWaited = 0, kWorked = 1 };
__host__ __device__ constexpr int start_slot(KernelId k) { return 2 * k; }
__host__ __device__ constexpr int end_slot(KernelId k) { return 2 * k + 1; }
__host__ __device__ constexpr int mark_slot(KernelId k, Mark m) {
  return 2 * kNumKernels + 2 * k + m;
}
constexpr int kBarrierEndSlot = 4 * kNumKernels;
constexpr int kTimingSlots = kBarrierEndSlot + 1;
// The handle keeps the stamps of this many samples (a sample: one barrier and the ops after
// it), so a benchmark can enqueue samples back to back and read them all at the end.
constexpr int kTimingSamples = 1024;

// Per-handle state in ordinary device memory, owned by the kernels. Epochs count completed
// launches of each kernel (the cycle number its flags carry); tickets elect the last block.
// Nothing per call lives on the host: XLA may record a handler's launches once into a CUDA
// graph (command buffers) and replay them, so a kernel argument never changes between calls.
struct DeviceState {
  uint64_t epoch[kNumKernels];
  uint32_t ticket[kNumKernels];
  uint64_t barrier_epoch;  // barriers completed on this handle
  uint32_t timing_opened;  // samples opened (barriers with timing on) since set_timing(true)
  // Set by close(). This state, the timing rows and the error record of a closed handle are
  // never freed (only its symmetric buffer is), so a launch that XLA replays from a command
  // buffer recorded before close() reads them safely, refuses, and is reported (kStaleLaunch)
  // instead of running on memory a newer handle may own.
  uint32_t closed;
  // Messages (puts, flag puts) each kernel sent to staged peers while the handle counted them
  // (CommonParams::count_staged), since creation or recover(): the staged path's per-cycle
  // message count, read by tests (jax_moe_comm._bench.staged_messages).
  uint64_t staged_messages[kNumKernels];
  // Rows dropped past a capacity (overflow "drop") since creation or recover(), added by
  // dispatch_recv's last block (module dropped_rows() reads it after a device sync). In device
  // memory: a read-modify-write of the pinned record was a PCIe round trip before the acks.
  uint64_t dropped_rows;
};

// Per-call scratch in ordinary device memory, zero between calls (the kernels restore it).
struct LocalScratch {
  DeviceState* state;
  uint32_t* send_count;   // [G] records this rank sent to the g-th destination
  uint32_t* expert_fill;  // [L] rows taken in each local expert
  uint32_t* home_fill;    // [world] rows packed for each staged home rank (combine_send)
  // Staged only: [combine_recv blocks][max_m * k] where each block finds slot (t, j)'s row in
  // combine_in: (low 32 bits of the epoch << 32) | entry; nullptr when no peer is staged.
  uint64_t* slot_map;
};

struct CommonParams {
  Shape shape;
  SymmetricLayout sym;
  PeerTable peers;  // the symmetric buffer as each peer's copy is mapped here (layout.h)
  LocalScratch scratch;
  ErrorRecord* error;  // device view of the pinned record
  // [kTimingSlots] %globaltimer stamps of the current sample, or nullptr (timing off when the
  // handler ran). Always the same row: the next barrier files it into the ring.
  uint64_t* timings;
  int rank;
  uint64_t timeout_ns;
  // How long a wait for a peer that has not started the cycle, while its process lives, may
  // take in all (protocol.cuh, wait_for_late_start); <= timeout_ns: no longer than any wait.
  uint64_t start_timeout_ns;
  bool release_acks;  // JMC_ACKS=release (handle.cc): acknowledgements with a release store
  bool count_staged;  // add each staged message to DeviceState::staged_messages (tests only)
};

struct DispatchSendParams {
  CommonParams c;
  const uint8_t* x;        // [max_m, H] dispatch dtype
  const float* x_scale;    // [max_m, S] or nullptr
  const int32_t* indices;  // [max_m, k], repeated experts already -1
  const float* weights;    // [max_m, k] or nullptr (then rows carry weight 0)
  const int32_t* num_tokens;
};

// Rows: Shape::output_rows() ([L, R] padded, [C] packed); row_source: row_source_entries().
struct DispatchRecvParams {
  CommonParams c;
  uint8_t* expert_x;           // [rows, H] dispatch dtype, or bf16 when dequantize
  float* expert_x_scale;       // [rows, S] or nullptr (always nullptr when dequantize)
  int32_t* expert_num_tokens;  // [L]
  int32_t* row_source;         // pack_source(...) of each row, then of each dropped row
  float* expert_weights;       // [rows] weight of the slot that made the row
  int32_t* dropped_rows;       // [1] rows dropped past a capacity this cycle
  // fp8 handles: write each row as bf16, payload times its block scales (core/fp8.cuh),
  // instead of the fp8 payload and the scales. A call's attribute, the same at every replay.
  bool dequantize;
};

struct CombineSendParams {
  CommonParams c;
  const uint8_t* expert_y;           // [rows, H] combine dtype, laid out as expert_x
  const int32_t* expert_num_tokens;  // [L]
  const int32_t* row_source;         // as dispatch_recv wrote it
  const int32_t* dropped_rows;       // [1] as dispatch_recv wrote it
};

struct CombineRecvParams {
  CommonParams c;
  const int32_t* indices;  // [max_m, k], repeated experts already -1
  const float* weights;    // [max_m, k], repeated experts' weights merged
  const int32_t* num_tokens;
  uint16_t* y;             // [max_m, H] bf16
  uint8_t* slot_rows;      // [max_m, k, H] combine dtype, or nullptr
};

struct BarrierParams {
  CommonParams c;
  uint64_t* timing_ring;  // [kTimingSamples][kTimingSlots]: finished samples' stamps
};

// Which instantiation of a body a launch runs (the bodies' template argument kPath): the
// families of runtime branches a handle can need, fixed for its life. A family left out of an
// instantiation folds away at compile time. With every family as runtime branches the kernels'
// machine code doubled (fused combine 3,752 -> 6,376 SASS instructions) and a 1-token cycle
// took ~5 us longer, so each path users run at decode sizes has its own instantiation.
enum PathBits : unsigned {
  kPathStaged = 1u,    // some peer is not load/store reachable: staged puts, NVSHMEM's hooks
  kPathPacked = 2u,    // the packed layout (Shape::packed)
  kPathCapacity = 4u,  // a capacity below the worst case: rows can drop (Shape::can_drop)
};
// The instantiations built. Direct: every peer load/store reachable (handle.cc refuses a
// direct handle with a peer nvshmem_ptr cannot reach).
constexpr unsigned kDirectPadded = 0u;                            // the padded worst case
constexpr unsigned kDirectPacked = kPathPacked | kPathCapacity;  // the layer's default handle
constexpr unsigned kGeneralPath = kPathStaged | kPathPacked | kPathCapacity;  // anything

__host__ __device__ constexpr bool may_stage(unsigned path) { return (path & kPathStaged) != 0; }
__host__ __device__ constexpr bool may_pack(unsigned path) { return (path & kPathPacked) != 0; }
__host__ __device__ constexpr bool may_drop(unsigned path) { return (path & kPathCapacity) != 0; }
// Whether a shape on `path` is packed: kDirectPacked runs packed handles only (launch_path), so
// there it is a constant and the padded branches fold away too.
__host__ __device__ inline bool path_packed(unsigned path, const Shape& s) {
  return path == kDirectPacked || (may_pack(path) && s.packed());
}

// The built instantiation that covers a handle: its own branch families, widened to one of the
// three above (a direct padded handle with a capacity takes the general path).
inline unsigned launch_path(const CommonParams& c) {
  if (c.sym.staged()) return kGeneralPath;
  if (c.shape.packed()) return kDirectPacked;
  return c.shape.can_drop() ? kGeneralPath : kDirectPadded;
}

// dispatch_send and combine_recv read neither the layout nor the capacity, only whether a peer
// is staged: they are built for these two paths, which a launch reduces its path to.
constexpr unsigned kDirectOnly = 0u;
constexpr unsigned kStagedOnly = kPathStaged;
__host__ __device__ constexpr unsigned staged_part(unsigned path) { return path & kPathStaged; }

// Calls f(std::integral_constant<unsigned, P>{}) with P the built path equal to `path` (the
// launchers' switch from a handle's runtime path to a template argument).
template <typename F>
cudaError_t with_path(unsigned path, F&& f) {
  switch (path) {
    case kDirectPadded: return f(std::integral_constant<unsigned, kDirectPadded>{});
    case kDirectPacked: return f(std::integral_constant<unsigned, kDirectPacked>{});
    default: return f(std::integral_constant<unsigned, kGeneralPath>{});
  }
}
template <typename F>
cudaError_t with_staged_part(unsigned path, F&& f) {
  if (may_stage(path)) return f(std::integral_constant<unsigned, kStagedOnly>{});
  return f(std::integral_constant<unsigned, kDirectOnly>{});
}

// Counters of a one-block launch (the fused ops) live in shared memory instead of the scratch
// arrays: no global atomic round trip per record or row, no reset at the end. Up to this many
// destinations (send counts) or local experts (row fill); wider shapes use the scratch arrays.
constexpr int kMaxBlockCounters = 256;

// Dynamic shared memory of the bodies that keep a prefix there (split and fused launches, and
// the occupancy queries): dispatch_recv's first_record [G + 1] (and, packed or with a
// per-expert capacity, expert_first [L + 1]), combine_send's first_row [L + 1].
inline size_t dispatch_recv_shared_bytes(const Shape& s) {
  const bool counted = s.packed() || s.can_drop();
  return sizeof(uint32_t) * (s.num_dp_groups() + 1 + (counted ? s.num_local_experts() + 1 : 0));
}
inline size_t combine_send_shared_bytes(const Shape& s) {
  return sizeof(int) * (s.num_local_experts() + 1);
}

cudaError_t launch_dispatch_send(const DispatchSendParams& p, Launch l, cudaStream_t s);
cudaError_t launch_dispatch_recv(const DispatchRecvParams& p, Launch l, cudaStream_t s);
cudaError_t launch_combine_send(const CombineSendParams& p, Launch l, cudaStream_t s);
cudaError_t launch_combine_recv(const CombineRecvParams& p, Launch l, cudaStream_t s);
cudaError_t launch_barrier(const BarrierParams& p, bool dependent_launch, cudaStream_t s);
// Benchmarks' floor (bench_loop --variants floor-*): a kernel of one warp that only waits for
// the kernels before it, so a loop of them times kernel boundaries alone.
cudaError_t launch_empty(bool dependent_launch, cudaStream_t s);
// True when the kernels loaded on this device were compiled from compute_90+ code, so they
// start with griddepcontrol.wait (core/launch.cuh) and may be launched as dependents.
bool kernels_wait_for_previous();

// The fused ops (kernels/fused.cu): both halves in one launch of one block.
enum FusedOp : int { kFusedDispatch = 0, kFusedCombine = 1 };
constexpr int kNumFusedOps = 2;
cudaError_t launch_dispatch(const DispatchSendParams& send, const DispatchRecvParams& recv,
                            Launch l, cudaStream_t s);
cudaError_t launch_combine(const CombineSendParams& send, const CombineRecvParams& recv,
                           Launch l, cudaStream_t s);
cudaError_t launch_timestamp(uint64_t* out, cudaStream_t s);

// Blocks of `kernel` that fit on one SM at `warps_per_block` (occupancy API), for sizing grids.
int blocks_per_sm(const Shape& s, KernelId kernel, int warps_per_block);

}  // namespace jmc
