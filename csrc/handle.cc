#include "handle.h"

#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>

namespace jmc {
namespace {

std::mutex g_mutex;
std::map<int64_t, std::unique_ptr<Handle>> g_handles;
std::map<int64_t, std::unique_ptr<DenseHandle>> g_dense;
int64_t g_next_id = 1;  // per-process counter: same sequence on every process

std::string cuda_failure(cudaError_t err, const char* what) {
  return std::string(what) + " failed: " + cudaGetErrorName(err) + " (" +
         cudaGetErrorString(err) + ")";
}

// One full wave on the SMs this process may use: the device's SM count, scaled by the MPS
// share when several processes split the GPU (the attribute still reports every SM under MPS),
// times the blocks that fit on an SM. More blocks only queue behind spinning ones; fewer leave
// too few warps copying (measured: 16 blocks of 16 warps made R1 T=128 1.5x slower).
int default_num_blocks(int warps_per_block) {
  int device = 0, sms = 0, threads_per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 16;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      sms <= 0)
    return 16;
  if (cudaDeviceGetAttribute(&threads_per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, device) !=
      cudaSuccess)
    threads_per_sm = 2048;
  const int blocks_per_sm = std::max(1, threads_per_sm / (warps_per_block * 32));
  if (const char* pct = std::getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")) {
    const int share = std::atoi(pct);
    if (share > 0 && share < 100) sms = std::max(1, (sms * share + 99) / 100);
  }
  return sms * blocks_per_sm;
}

}  // namespace

std::string validate_shape(const Shape& s) {
  if (s.num_experts < 1 || s.experts_per_token < 1 || s.hidden < 1 || s.max_num_tokens < 1 ||
      s.world_size < 1 || s.dp_size < 1)
    return "every size must be positive";
  if (s.experts_per_token > s.num_experts) return "experts_per_token exceeds num_experts";
  if (s.num_experts % s.world_size) return "num_experts is not divisible by world_size";
  if (s.world_size % s.dp_size) return "world_size is not divisible by dp_size";
  if ((s.hidden * s.in_elem_bytes) % 16 || (s.hidden * s.out_elem_bytes) % 16 || s.hidden % 8)
    return "rows must be a multiple of 16 bytes";
  if (s.in_elem_bytes != 1 && s.in_elem_bytes != 2) return "dispatch element must be 1 or 2 bytes";
  if (s.out_elem_bytes != 2 && s.out_elem_bytes != 4) return "combine element must be 2 or 4 bytes";
  const int64_t sources = static_cast<int64_t>(s.num_dp_groups()) * s.max_num_tokens *
                          s.experts_per_token;
  if (sources >= (int64_t{1} << 31)) return "num_dp_groups * max_num_tokens * k overflows int32";
  return "";
}

std::string create_handle(const Shape& shape, Launch launch, uint64_t timeout_ns,
                          int64_t* id_out) {
  const std::string bad = validate_shape(shape);
  if (!bad.empty()) return bad;
  if (nvshmemx_init_status() < NVSHMEM_STATUS_IS_INITIALIZED)
    return "NVSHMEM is not initialized: call jax_moe_comm.init() first";
  if (nvshmem_n_pes() != shape.world_size)
    return "world_size=" + std::to_string(shape.world_size) + " but NVSHMEM has " +
           std::to_string(nvshmem_n_pes()) + " PEs";

  auto h = std::make_unique<Handle>();
  h->shape = shape;
  h->rank = nvshmem_my_pe();
  h->launch = launch;
  if (h->launch.warps_per_block < 2 || h->launch.warps_per_block > 32)
    return "warps_per_block must be in [2, 32]";
  if (h->launch.num_blocks <= 0) h->launch.num_blocks = default_num_blocks(h->launch.warps_per_block);
  h->timeout_ns = timeout_ns;

  size_t bytes = 0;
  SymmetricLayout::carve(shape, nullptr, &bytes);
  h->symmetric = nvshmem_malloc(bytes);  // collective
  if (h->symmetric == nullptr)
    return "nvshmem_malloc of " + std::to_string(bytes) +
           " bytes failed (raise NVSHMEM_SYMMETRIC_SIZE)";
  h->symmetric_bytes = bytes;
  h->sym = SymmetricLayout::carve(shape, h->symmetric, &bytes);
  cudaError_t err = cudaMemset(h->symmetric, 0, h->sym.flag_bytes());
  if (err != cudaSuccess) return cuda_failure(err, "cudaMemset(symmetric flags)");

  const size_t L = shape.num_local_experts();
  const size_t scratch_words = shape.world_size + L + 4;
  err = cudaMalloc(&h->scratch_memory, scratch_words * sizeof(uint32_t));
  if (err != cudaSuccess) return cuda_failure(err, "cudaMalloc(scratch)");
  err = cudaMemset(h->scratch_memory, 0, scratch_words * sizeof(uint32_t));
  if (err != cudaSuccess) return cuda_failure(err, "cudaMemset(scratch)");
  auto* words = static_cast<uint32_t*>(h->scratch_memory);
  h->scratch = LocalScratch{words, words + shape.world_size, words + shape.world_size + L};

  err = cudaMalloc(&h->timings, kTimingSlots * sizeof(uint64_t));
  if (err != cudaSuccess) return cuda_failure(err, "cudaMalloc(timings)");
  err = cudaHostAlloc(reinterpret_cast<void**>(&h->error_host), sizeof(ErrorRecord),
                      cudaHostAllocMapped);
  if (err != cudaSuccess) return cuda_failure(err, "cudaHostAlloc(error record)");
  *h->error_host = ErrorRecord{};
  err = cudaHostGetDevicePointer(reinterpret_cast<void**>(&h->error_device), h->error_host, 0);
  if (err != cudaSuccess) return cuda_failure(err, "cudaHostGetDevicePointer(error record)");
  err = cudaDeviceSynchronize();
  if (err != cudaSuccess) return cuda_failure(err, "cudaDeviceSynchronize");
  nvshmem_barrier_all();  // every rank's flags are zero before anyone signals

  std::lock_guard<std::mutex> lock(g_mutex);
  h->id = g_next_id++;
  *id_out = h->id;
  g_handles[h->id] = std::move(h);
  return "";
}

std::string destroy_handle(int64_t id) {
  std::unique_ptr<Handle> h;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_handles.find(id);
    if (it == g_handles.end()) return "no handle with id " + std::to_string(id);
    h = std::move(it->second);
    g_handles.erase(it);
  }
  cudaDeviceSynchronize();
  nvshmem_barrier_all();  // nobody still writes into our buffers
  nvshmem_free(h->symmetric);
  cudaFree(h->scratch_memory);
  cudaFree(h->timings);
  cudaFreeHost(h->error_host);
  return "";
}

std::string create_dense_handle(int world_size, size_t chunk_bytes, int64_t* id_out) {
  if (nvshmemx_init_status() < NVSHMEM_STATUS_IS_INITIALIZED)
    return "NVSHMEM is not initialized: call jax_moe_comm.init() first";
  auto h = std::make_unique<DenseHandle>();
  h->world_size = world_size;
  h->chunk_bytes = chunk_bytes;
  h->src = nvshmem_malloc(world_size * chunk_bytes);
  h->dst = nvshmem_malloc(world_size * chunk_bytes);
  if (h->src == nullptr || h->dst == nullptr) return "nvshmem_malloc failed for the dense a2a";
  const cudaError_t err = cudaMalloc(&h->timings, 2 * sizeof(uint64_t));
  if (err != cudaSuccess) return cuda_failure(err, "cudaMalloc(dense timings)");
  std::lock_guard<std::mutex> lock(g_mutex);
  h->id = g_next_id++;
  *id_out = h->id;
  g_dense[h->id] = std::move(h);
  return "";
}

std::string destroy_dense_handle(int64_t id) {
  std::unique_ptr<DenseHandle> h;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_dense.find(id);
    if (it == g_dense.end()) return "no dense handle with id " + std::to_string(id);
    h = std::move(it->second);
    g_dense.erase(it);
  }
  cudaDeviceSynchronize();
  nvshmem_barrier_all();
  nvshmem_free(h->dst);
  nvshmem_free(h->src);
  cudaFree(h->timings);
  return "";
}

Handle* find_handle(int64_t id) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_handles.find(id);
  return it == g_handles.end() ? nullptr : it->second.get();
}

DenseHandle* find_dense_handle(int64_t id) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_dense.find(id);
  return it == g_dense.end() ? nullptr : it->second.get();
}

std::string describe_error(const ErrorRecord& rec) {
  static const char* kPhases[] = {"?", "dispatch_send", "dispatch_recv", "combine_send",
                                  "combine_recv", "barrier"};
  const char* phase = rec.phase < 6 ? kPhases[rec.phase] : "?";
  const std::string where = std::string(" in ") + phase;
  switch (rec.code) {
    case kOk:
      return "";
    case kPeerTimeout:
      return "PeerTimeout:" + where + ": waited for " +
             (rec.peer >= 0 ? "rank " + std::to_string(rec.peer)
                            : "the rows of token " + std::to_string(rec.token)) +
             ", expected >= " + std::to_string(rec.expected) + ", saw " +
             std::to_string(rec.seen) + " when the timeout passed";
    case kBadExpertIndex:
      return "InvalidRouting:" + where + ": token " + std::to_string(rec.token) +
             " has expert index " + std::to_string(static_cast<int64_t>(rec.seen)) +
             " outside [-1, " + std::to_string(rec.expected) + ")";
    case kBadNumTokens:
      return "InvalidRouting:" + where + ": num_tokens=" +
             std::to_string(static_cast<int64_t>(rec.seen)) + " outside [0, " +
             std::to_string(rec.expected) + "]";
    default:
      return "Unknown: error code " + std::to_string(rec.code) + where;
  }
}

}  // namespace jmc
