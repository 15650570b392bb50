// Persistent all-to-all handles: symmetric buffers, device state, error record and the host
// side of the protocol (which half is in flight), owned outside XLA and looked up by the
// stable integer id baked into the HLO.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "core/error_record.h"
#include "core/layout.h"
#include "kernels/kernels.h"

namespace jmc {

struct Handle {
  int64_t id = 0;
  Shape shape{};
  int rank = 0;
  Launch launch[kNumKernels]{};         // the split ops' kernels
  Launch fused_launch[kNumFusedOps]{};  // dispatch, combine; 0 blocks: split kernels instead
  uint64_t timeout_ns = 0;
  uint64_t start_timeout_ns = 0;  // CommonParams::start_timeout_ns
  bool dependent_launch = false;  // kernels start as programmatic dependents (core/launch.cuh)
  bool staged = false;        // some peer is not reachable by load/store
  bool release_acks = false;  // JMC_ACKS=release: CommonParams::release_acks
  void* symmetric = nullptr;  // one nvshmem_malloc
  size_t symmetric_bytes = 0;
  SymmetricLayout sym{};
  PeerTable peers{};  // nvshmem_ptr(symmetric, pe) for pe < kMaxPeerTable (layout.h)
  void* scratch_memory = nullptr;  // cudaMalloc: DeviceState + send_count + expert_fill + home_fill
  void* slot_map_memory = nullptr;  // cudaMalloc, staged only: LocalScratch::slot_map
  size_t slot_map_bytes = 0;
  LocalScratch scratch{};
  ErrorRecord* error_host = nullptr;    // pinned, mapped
  ErrorRecord* error_device = nullptr;  // device view of the same memory
  // device, [kTimingSamples + 1][kTimingSlots]: the ring of finished samples, then the
  // current sample's row (the kernels stamp it; the next barrier files it into the ring).
  // Allocated by the first set_timing(true) (ensure_timing_rows); null until then.
  uint64_t* timings = nullptr;
  std::string create_error;             // non-empty: this rank failed to create it
  // Cycles every rank completed cleanly before the last recover() (its agreement), so that
  // quiesce_handle counts from creation although recover() restarts the device's counts.
  uint64_t cycles_before_reset = 0;

  // Guarded by `mutex`, which a handler holds for its whole call (check, launch).
  std::mutex mutex;
  bool closed = false;
  int64_t handler_calls = 0;  // handler executions (XLA replaying a graph runs none)
  // Benchmarks: the kernels write %globaltimer stamps. Read when a handler runs, so a call
  // XLA recorded into a CUDA graph keeps the setting it was recorded with.
  bool timing = false;
  // Benchmarks and tests: each staged message adds to DeviceState::staged_messages
  // (CommonParams::count_staged). Read when a handler runs, as `timing`.
  bool count_staged = false;

  uint64_t* current_timings() const { return timings + size_t{kTimingSamples} * kTimingSlots; }
  CommonParams common() const {
    return CommonParams{shape, sym, peers, scratch, error_device,
                        timing ? current_timings() : nullptr, rank, timeout_ns, start_timeout_ns,
                        release_acks, count_staged};
  }
};

// Dense all-to-all baseline: two symmetric buffers of world * chunk bytes.
struct DenseHandle {
  int64_t id = 0;
  size_t chunk_bytes = 0;
  int world_size = 0;
  void* src = nullptr;
  void* dst = nullptr;
  uint64_t* timings = nullptr;  // device, [start, end] of the last call
};

// All of these run on the host, outside any FFI execute (nvshmem_malloc is collective).
// They return an empty string on success, else what went wrong.
//
// create_handle: a shape error is returned before anything collective (every rank sees the
// same shape: the Python side checks that through the key-value store). Past that point every
// rank takes part in the collective allocation and barrier whatever happens locally, and the
// handle is registered (*id_out) even when this rank's part failed, so that every rank can
// then destroy it collectively.
// start_epoch (tests): the handle starts as if `start_epoch` cycles had completed (every launch
// count, and this rank's acknowledgements from every peer), to run cycles across epoch values
// a server reaches after months (the same on every rank).
// staged_node_size > 0 (KernelTuning.transport="staged"): peers outside this rank's block of
// staged_node_size consecutive ranks get no load/store pointer in the peer table, so the
// kernels send to them exactly as to a peer on another node (`staged` must then be true).
std::string create_handle(const Shape& shape, Launch tuning, uint64_t timeout_ns,
                          uint64_t start_timeout_ns, bool staged, int staged_node_size,
                          uint64_t start_epoch, int64_t* id_out);
// Marks the handle closed on the device first, then frees the symmetric buffer; its small local
// state (DeviceState, counters, error record, timing rows if any) is kept for the life of the process, so a launch replayed from a
// command buffer recorded before close() reads valid memory, refuses and records kStaleLaunch
// (closed_handle_error reads it).
std::string destroy_handle(int64_t id);
// recover(), step 1 (local): waits for this rank's kernels and, on a staged handle, for the
// network puts they queued (a quiet); then *clean_out = the cycles this rank completed with no
// error since creation (the cycles before its first error). The ranks agree on those counts
// (Python, through the key-value store) before step 2.
std::string quiesce_handle(int64_t id, uint64_t* clean_out);
// recover(), step 2 (collective): between two barriers of all ranks clears every flag, launch
// count, counter, the abort word and the error record, and counts `agreed_cycles` as
// completed. The same handle, with the same buffers (so the same compiled steps), starts
// again at the device's cycle 1.
std::string recover_handle(int64_t id, uint64_t agreed_cycles);
// The timing rows, allocated on the first set_timing(true) (most handles never time).
std::string ensure_timing_rows(Handle* h);
// Handles created and not yet destroyed in this process (finalize() refuses while any is).
size_t open_handles();
// The error a stale launch recorded on closed handle `id` ("" if none, or if `id` was never a
// handle of this process).
std::string closed_handle_error(int64_t id);
std::string create_dense_handle(int world_size, size_t chunk_bytes, int64_t* id_out);
std::string destroy_dense_handle(int64_t id);
// Collective: whether every peer's symmetric memory is reachable by load/store from here.
bool probe_peers_p2p();

std::shared_ptr<Handle> find_handle(int64_t id);  // open handles only
// Open, or closed and kept (destroy_handle): the handlers count and refuse calls on a closed
// one, so a step re-recorded after close() is told apart from one XLA replayed.
std::shared_ptr<Handle> find_open_or_closed_handle(int64_t id);
std::shared_ptr<DenseHandle> find_dense_handle(int64_t id);

// Checks a shape the same way the Python config does.
std::string validate_shape(const Shape& s);

}  // namespace jmc
