#include "handle.h"

#include "error_text.h"
#include "heartbeat.h"
#include "launch_plan.h"

#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <vector>

namespace jmc {
namespace {

std::mutex g_mutex;  // guards the maps and the id counter
std::map<int64_t, std::shared_ptr<Handle>> g_handles;
std::map<int64_t, std::shared_ptr<Handle>> g_closed;  // closed handles' kept local state
std::map<int64_t, std::shared_ptr<DenseHandle>> g_dense;
int64_t g_next_id = 1;  // per-process counter: same sequence on every process

std::string cuda_failure(cudaError_t err, const char* what) {
  return std::string(what) + " failed: " + cudaGetErrorName(err) + " (" +
         cudaGetErrorString(err) + ")";
}

// Local (non-collective) allocations; "" or what failed.
std::string allocate_local(Handle* h) {
  const Shape& s = h->shape;
  const size_t G = s.num_dp_groups(), L = s.num_local_experts(), W = s.world_size;
  const size_t bytes = sizeof(DeviceState) + sizeof(uint32_t) * (G + L + W);
  cudaError_t err = cudaMalloc(&h->scratch_memory, bytes);
  if (err != cudaSuccess) return cuda_failure(err, "cudaMalloc(scratch)");
  err = cudaMemset(h->scratch_memory, 0, bytes);
  if (err != cudaSuccess) return cuda_failure(err, "cudaMemset(scratch)");
  auto* state = static_cast<DeviceState*>(h->scratch_memory);
  auto* words = reinterpret_cast<uint32_t*>(state + 1);
  h->scratch = LocalScratch{state, words, words + G, words + G + L, nullptr};
  if (h->staged) {  // one slot map per combine_recv block (the fused combine: one block)
    const size_t blocks = std::max(1, h->launch[kCombineRecvKernel].num_blocks);
    const size_t map_bytes = blocks * s.max_num_tokens * s.experts_per_token * sizeof(uint64_t);
    err = cudaMalloc(&h->slot_map_memory, map_bytes);
    if (err != cudaSuccess) return cuda_failure(err, "cudaMalloc(slot map)");
    h->slot_map_bytes = map_bytes;
    h->scratch.slot_map = static_cast<uint64_t*>(h->slot_map_memory);
  }
  err = cudaHostAlloc(reinterpret_cast<void**>(&h->error_host), sizeof(ErrorRecord),
                      cudaHostAllocMapped);
  if (err != cudaSuccess) return cuda_failure(err, "cudaHostAlloc(error record)");
  *h->error_host = ErrorRecord{};
  err = cudaHostGetDevicePointer(reinterpret_cast<void**>(&h->error_device), h->error_host, 0);
  if (err != cudaSuccess) return cuda_failure(err, "cudaHostGetDevicePointer(error record)");
  return "";
}

// This rank's copy of the protocol state as if `epoch` cycles had completed: every flag zero
// except the acknowledgements from every peer (SET to `epoch`, so the next cycle's sends do not
// wait), every launch count at `epoch`, tickets, barrier epoch, counters and the error record
// clear. Local: callers put it between barriers of all ranks.
std::string reset_protocol_state(Handle* h, uint64_t epoch) {
  const Shape& s = h->shape;
  cudaError_t err = cudaMemset(h->symmetric, 0, h->sym.flag_bytes());
  if (err != cudaSuccess) return cuda_failure(err, "cudaMemset(flags)");
  if (epoch != 0) {
    const std::vector<uint64_t> acks(s.world_size, epoch);
    for (uint64_t* ack : {h->sym.dispatch_ack, h->sym.combine_ack}) {
      err = cudaMemcpy(ack, acks.data(), acks.size() * sizeof(uint64_t), cudaMemcpyHostToDevice);
      if (err != cudaSuccess) return cuda_failure(err, "cudaMemcpy(acks)");
    }
  }
  DeviceState state{};
  err = cudaMemcpy(&state, h->scratch.state, sizeof(state), cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) return cuda_failure(err, "cudaMemcpy(state)");
  const uint32_t timing_opened = state.timing_opened;  // the benchmark's counter stays
  state = DeviceState{};
  for (uint64_t& e : state.epoch) e = epoch;
  state.timing_opened = timing_opened;
  err = cudaMemcpy(h->scratch.state, &state, sizeof(state), cudaMemcpyHostToDevice);
  if (err != cudaSuccess) return cuda_failure(err, "cudaMemcpy(state)");
  const size_t counters =
      sizeof(uint32_t) * (s.num_dp_groups() + s.num_local_experts() + s.world_size);
  err = cudaMemset(h->scratch.send_count, 0, counters);
  if (err != cudaSuccess) return cuda_failure(err, "cudaMemset(counters)");
  if (h->slot_map_memory != nullptr) {  // no entry of an earlier epoch 1, 2, ... may pass
    err = cudaMemset(h->slot_map_memory, 0, h->slot_map_bytes);
    if (err != cudaSuccess) return cuda_failure(err, "cudaMemset(slot map)");
  }
  err = cudaDeviceSynchronize();
  if (err != cudaSuccess) return cuda_failure(err, "cudaDeviceSynchronize");
  *h->error_host = ErrorRecord{};  // after the sync: no kernel of ours writes it any more
  return "";
}

// Staged handles: the puts our kernels queued to NVSHMEM's proxy (network peers) may still be
// in flight after the kernels end; a quiet on a stream completes them, so none lands after
// the reset or free that follows. Load/store peers have nothing queued. Callers synced first.
std::string quiet_network_puts(Handle* h) {
  if (!h->staged) return "";
  cudaStream_t stream = nullptr;
  cudaError_t err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (err != cudaSuccess) return cuda_failure(err, "cudaStreamCreate(quiet)");
  nvshmemx_quiet_on_stream(stream);
  err = cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
  return err == cudaSuccess ? "" : cuda_failure(err, "nvshmemx_quiet_on_stream");
}

void free_local(Handle* h) {
  if (h->scratch_memory) cudaFree(h->scratch_memory);
  if (h->slot_map_memory) cudaFree(h->slot_map_memory);
  h->slot_map_memory = nullptr;
  if (h->timings) cudaFree(h->timings);
  if (h->error_host) cudaFreeHost(h->error_host);
  h->scratch_memory = nullptr;
  h->timings = nullptr;
  h->error_host = nullptr;
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
  // Shared-memory prefixes: [G + 1] in dispatch_recv, [L + 1] in combine_send.
  if (s.num_dp_groups() > 8192 || s.num_local_experts() > 8192)
    return "num_dp_groups and num_experts / world_size must be <= 8192";
  if (s.packed_rows < 0 || s.packed_rows > s.max_recv_rows())
    return "packed_rows (max_recv_rows) must be in [1, " + std::to_string(s.max_recv_rows()) +
           "], or 0 for the padded layout";
  if (s.drop_overflow != 0 && s.drop_overflow != 1) return "drop_overflow must be 0 or 1";
  if (s.expert_rows < 0 || s.expert_rows > s.max_recv_tokens())
    return "expert_rows (expert_capacity) must be in [1, " +
           std::to_string(s.max_recv_tokens()) + "], or 0 for the worst case";
  if (s.expert_rows > 0 && s.packed())
    return "expert_rows (expert_capacity) is for the padded layout, packed_rows for packed";
  if (s.row_source_entries() >= (int64_t{1} << 31)) return "row_source overflows int32";
  // dispatch_recv's dynamic shared memory: first_record [G + 1] and expert_first [L + 1], under
  // the 48 KB a launch gets without opting in (the kernels' static arrays take ~2 KB).
  if (s.num_dp_groups() + s.num_local_experts() + 2 > 11000)
    return "num_dp_groups + num_experts / world_size must be <= 10998";
  return "";
}

std::string create_handle(const Shape& shape, Launch tuning, uint64_t timeout_ns,
                          uint64_t start_timeout_ns, bool staged, int staged_node_size,
                          uint64_t start_epoch, int64_t* id_out) {
  *id_out = 0;
  const std::string bad = validate_shape(shape);
  if (!bad.empty()) return bad;
  if (tuning.warps_per_block < 2 || tuning.warps_per_block > kMaxWarpsPerBlock)
    return "warps_per_block must be in [2, " + std::to_string(kMaxWarpsPerBlock) + "]";
  LaunchPlan plan;
  const std::string refused = plan_launch(shape, tuning, &plan);  // reads the JMC_* settings
  if (!refused.empty()) return refused;
  if (staged_node_size > 0) {  // the same on every rank (agreed before): safe to return here
    if (shape.world_size > kMaxPeerTable)
      return "transport='staged' emulates nodes through the peer table: up to " +
             std::to_string(kMaxPeerTable) + " ranks";
    if (shape.world_size % staged_node_size)
      return "world_size is not divisible by the staged transport's node_size";
    if (staged_node_size < shape.world_size && !staged)
      return "a staged transport needs the staging buffers (staged=true)";
  }
  if (staged && shape.world_size > kMaxBlockCounters)  // combine_recv's per-sender counts
    return "staged peers (a network transport) are supported up to " +
           std::to_string(kMaxBlockCounters) + " ranks";
  if (nvshmemx_init_status() < NVSHMEM_STATUS_IS_INITIALIZED)
    return "NVSHMEM is not initialized: call jax_moe_comm.init() first";
  if (nvshmem_n_pes() != shape.world_size)
    return "world_size=" + std::to_string(shape.world_size) + " but NVSHMEM has " +
           std::to_string(nvshmem_n_pes()) + " PEs";

  // From here on every rank reaches the collective allocation and the barrier.
  auto h = std::make_shared<Handle>();
  h->shape = shape;
  h->rank = nvshmem_my_pe();
  h->timeout_ns = timeout_ns;
  h->start_timeout_ns = start_timeout_ns;
  h->staged = staged;
  h->release_acks = plan.release_acks;
  h->dependent_launch = plan.dependent_launch;
  std::copy(std::begin(plan.launch), std::end(plan.launch), std::begin(h->launch));
  std::copy(std::begin(plan.fused_launch), std::end(plan.fused_launch),
            std::begin(h->fused_launch));
  std::string error = allocate_local(h.get());  // local first: nothing collective can fail on it

  size_t bytes = 0;
  SymmetricLayout::carve(shape, staged, nullptr, &bytes);
  h->symmetric = nvshmem_malloc(bytes);  // collective
  if (h->symmetric == nullptr && error.empty())
    error = "nvshmem_malloc of " + std::to_string(bytes) +
            " bytes failed (raise NVSHMEM_SYMMETRIC_SIZE)";
  if (h->symmetric != nullptr) {
    h->symmetric_bytes = bytes;
    h->sym = SymmetricLayout::carve(shape, staged, h->symmetric, &bytes);
    for (int pe = 0; pe < std::min(shape.world_size, kMaxPeerTable); ++pe) {
      const bool emulated_remote =
          staged_node_size > 0 && pe / staged_node_size != h->rank / staged_node_size;
      h->peers.base[pe] =
          emulated_remote ? nullptr : static_cast<uint8_t*>(nvshmem_ptr(h->symmetric, pe));
    }
    // Unstaged, the kernels write every peer through load/store (the direct instantiation,
    // kernels.h launch_path, has no staged branch at all): a peer nvshmem_ptr cannot reach
    // would be a write through nullptr. Python stages such handles; a direct caller gets this.
    // (error, not return: the caller's status exchange frees the handle on every rank.)
    for (int pe = 0; !staged && error.empty() && pe < shape.world_size; ++pe)
      if (nvshmem_ptr(h->symmetric, pe) == nullptr)
        error = "PE " + std::to_string(pe) + " is not reachable by load/store from PE " +
                std::to_string(h->rank) + " (nvshmem_ptr is null) and the handle is not staged";
    if (error.empty()) error = reset_protocol_state(h.get(), start_epoch);
    int device = 0;
    if (error.empty() && cudaGetDevice(&device) == cudaSuccess)
      error = heartbeat_watch(h->sym.heartbeat, device);  // beats from before the barrier
  }
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess && error.empty()) error = cuda_failure(err, "cudaDeviceSynchronize");
  nvshmem_barrier_all();  // every rank's flags are zero before anyone signals

  h->create_error = error;
  std::lock_guard<std::mutex> lock(g_mutex);
  h->id = g_next_id++;
  *id_out = h->id;
  g_handles[h->id] = std::move(h);
  return error;
}

std::string destroy_handle(int64_t id) {
  std::shared_ptr<Handle> h;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_handles.find(id);
    if (it == g_handles.end()) return "no handle with id " + std::to_string(id);
    h = it->second;
    g_handles.erase(it);
  }
  std::lock_guard<std::mutex> lock(h->mutex);  // no handler is mid-call
  h->closed = true;
  // Closed on the device before anything is freed: a launch replayed from a command buffer
  // from here on refuses at its start instead of touching buffers that are about to go.
  const uint32_t closed = 1;
  cudaError_t err = cudaSuccess;
  if (h->scratch.state != nullptr)
    err = cudaMemcpy(&h->scratch.state->closed, &closed, sizeof(closed), cudaMemcpyHostToDevice);
  cudaDeviceSynchronize();
  std::string error = err == cudaSuccess ? quiet_network_puts(h.get())
                                         : cuda_failure(err, "cudaMemcpy(closed)");
  if (h->symmetric) heartbeat_forget(h->sym.heartbeat);
  nvshmem_barrier_all();  // nobody still writes into our buffers
  if (h->symmetric) nvshmem_free(h->symmetric);
  h->symmetric = nullptr;
  if (h->slot_map_memory != nullptr) cudaFree(h->slot_map_memory);
  h->slot_map_memory = nullptr;
  if (h->scratch.state == nullptr) {  // creation failed before the local state existed
    free_local(h.get());
    return error;
  }
  // The slot map goes (a stale launch refuses before it would read it); the rest is kept for
  // the life of the process (DeviceState and the counters, a few hundred bytes, and the pinned
  // error record; the timing rows only where timing was ever on): a command buffer recorded
  // before close() may still replay our launches with these addresses.
  *h->error_host = ErrorRecord{};  // after the sync above: a stale launch records afresh
  std::lock_guard<std::mutex> g(g_mutex);
  g_closed[id] = h;
  return error;
}

std::string quiesce_handle(int64_t id, uint64_t* clean_out) {
  *clean_out = 0;
  const std::shared_ptr<Handle> h = find_handle(id);
  if (h == nullptr) return "no open handle with id " + std::to_string(id);
  std::lock_guard<std::mutex> lock(h->mutex);  // no handler is mid-call
  if (!h->create_error.empty()) return "its creation failed: " + h->create_error;
  // Our kernels end: every wait is bounded by the timeout, and they give up at once when the
  // abort word is set, so this returns.
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) return cuda_failure(err, "cudaDeviceSynchronize");
  std::string error = quiet_network_puts(h.get());
  if (!error.empty()) return error;
  uint64_t done = 0;  // combine_recv's launches: cycles that ended, failed ones included
  const cudaError_t copied = cudaMemcpy(&done, &h->scratch.state->epoch[kCombineRecvKernel],
                                        sizeof(done), cudaMemcpyDeviceToHost);
  if (copied != cudaSuccess) return cuda_failure(copied, "cudaMemcpy(epoch)");
  // After the first error every later cycle is poisoned, so the clean ones are those before it.
  const ErrorRecord& rec = *h->error_host;
  const uint64_t clean = rec.code != kOk && rec.cycle > 0 ? std::min(done, rec.cycle - 1) : done;
  *clean_out = h->cycles_before_reset + clean;
  return "";
}

std::string recover_handle(int64_t id, uint64_t agreed_cycles) {
  const std::shared_ptr<Handle> h = find_handle(id);
  if (h == nullptr) return "no open handle with id " + std::to_string(id);
  std::lock_guard<std::mutex> lock(h->mutex);  // no handler is mid-call
  if (!h->create_error.empty()) return "its creation failed: " + h->create_error;
  // quiesce_handle ran on every rank before the agreement: after this barrier no rank's kernel
  // still runs and no put of ours is in flight.
  const cudaError_t err = cudaDeviceSynchronize();
  nvshmem_barrier_all();
  std::string error =
      err == cudaSuccess ? reset_protocol_state(h.get(), 0) : cuda_failure(err, "sync");
  if (error.empty()) h->cycles_before_reset = agreed_cycles;
  nvshmem_barrier_all();  // every rank is clean before any rank's next cycle signals
  return error;
}

std::string ensure_timing_rows(Handle* h) {
  if (h->timings != nullptr) return "";
  const size_t bytes = size_t{kTimingSamples + 1} * kTimingSlots * sizeof(uint64_t);
  cudaError_t err = cudaMalloc(&h->timings, bytes);
  if (err != cudaSuccess) {
    h->timings = nullptr;
    return cuda_failure(err, "cudaMalloc(timings)");
  }
  err = cudaMemset(h->timings, 0, bytes);
  return err == cudaSuccess ? "" : cuda_failure(err, "cudaMemset(timings)");
}

size_t open_handles() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_handles.size();
}

std::string closed_handle_error(int64_t id) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_closed.find(id);
  if (it == g_closed.end() || it->second->error_host == nullptr) return "";
  return describe_error(*it->second->error_host, it->second->rank);
}

bool probe_peers_p2p() {
  void* probe = nvshmem_malloc(128);  // collective
  bool all = probe != nullptr;
  for (int pe = 0; all && pe < nvshmem_n_pes(); ++pe) all = nvshmem_ptr(probe, pe) != nullptr;
  if (probe) nvshmem_free(probe);
  return all;
}

std::string create_dense_handle(int world_size, size_t chunk_bytes, int64_t* id_out) {
  if (nvshmemx_init_status() < NVSHMEM_STATUS_IS_INITIALIZED)
    return "NVSHMEM is not initialized: call jax_moe_comm.init() first";
  auto h = std::make_shared<DenseHandle>();
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
  std::shared_ptr<DenseHandle> h;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_dense.find(id);
    if (it == g_dense.end()) return "no dense handle with id " + std::to_string(id);
    h = it->second;
    g_dense.erase(it);
  }
  cudaDeviceSynchronize();
  nvshmem_barrier_all();
  nvshmem_free(h->dst);
  nvshmem_free(h->src);
  cudaFree(h->timings);
  return "";
}

std::shared_ptr<Handle> find_handle(int64_t id) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_handles.find(id);
  return it == g_handles.end() ? nullptr : it->second;
}

std::shared_ptr<Handle> find_open_or_closed_handle(int64_t id) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_handles.find(id);
  if (it != g_handles.end()) return it->second;
  auto closed = g_closed.find(id);
  return closed == g_closed.end() ? nullptr : closed->second;
}

std::shared_ptr<DenseHandle> find_dense_handle(int64_t id) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_dense.find(id);
  return it == g_dense.end() ? nullptr : it->second;
}

}  // namespace jmc
