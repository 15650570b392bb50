// Where kernels leave the first error they meet: pinned, device-mapped host memory, so the host
// reads it without a device sync. The first error wins; later ones are dropped.
#pragma once

#include <cuda_runtime.h>  // __host__ __device__

#include <cstdint>

namespace jmc {

enum ErrorCode : uint32_t {
  kOk = 0,
  kPeerTimeout = 1,     // a bounded wait for a peer ran out
  kBadExpertIndex = 2,  // an expert index outside [-1, num_experts)
  kBadNumTokens = 3,    // num_tokens outside [0, max_num_tokens]
  kCorruptData = 4,     // a value read from a peer or from routing is out of range (`what`)
  kPeerAborted = 5,     // a peer reported an error first (its abort word reached us)
  kOutOfOrder = 6,      // a launch out of its half's order (recv before send, send twice)
  kStaleLaunch = 7,     // a launch on a closed handle (a replayed command buffer): did nothing
  kCapacityExceeded = 8,  // rows arrived past a capacity (packed or per expert; overflow "fail")
};

enum Phase : uint32_t {
  kPhaseNone = 0,
  kPhaseDispatchSend = 1,
  kPhaseDispatchRecv = 2,
  kPhaseCombineSend = 3,
  kPhaseCombineRecv = 4,
  kPhaseBarrier = 5,
};

// What a kCorruptData or kPeerTimeout record is about.
enum What : uint32_t {
  kWhatNone = 0,
  kWhatAck = 1,        // a receiver's "done reading" acknowledgement
  kWhatCount = 2,      // a sender's record count
  kWhatRecord = 3,     // a token record's flag or header
  kWhatRow = 4,        // an expert row: the row index, its source, or its flag
  kWhatEpoch = 5,      // a flag carrying another cycle's epoch
  kWhatExpertCount = 6,  // expert_num_tokens handed to combine
  kWhatRowCount = 7,     // a staged sender's count of the rows it put for us (combine)
  kWhatExpertRows = 8,   // kCapacityExceeded of the padded layout: rows past a per-expert capacity
};

// A timeout's view of the rank it waited for: which of that rank's kernels the wait needed
// (KernelId + 1, 0: no view) and of which cycle, and the cycle of that rank's latest start of
// each kernel, read from its symmetric buffer when the wait gave up. Tells "has not started the
// cycle" from "started, stalled inside".
// `late` says what a wait for a peer that had not started the cycle saw of its host
// (protocol.cuh, wait_for_late_start): kLateNotWaited (no such wait: the peer had started, or
// is not load/store reachable, or start_timeout_s <= timeout_s), kLateAlive (its heartbeat went
// on until start_timeout_s ran out), kLateSilent (its heartbeat stopped: the process is gone or
// its host hangs).
enum Late : uint32_t { kLateNotWaited = 0, kLateAlive = 1, kLateSilent = 2 };
struct PeerView {
  uint32_t needed_kernel;
  uint32_t late;
  uint64_t needed_cycle;
  uint64_t started[4];
};

struct ErrorRecord {
  uint32_t code;      // written last: the host reads it without a sync
  uint32_t phase;
  int32_t peer;       // rank waited for or reporting, or -1
  int32_t token;      // token index involved, or -1
  uint64_t expected;  // value waited for / allowed bound
  uint64_t seen;      // last value read / bad value
  uint32_t what;
  uint32_t claimed;   // first-wins ticket, so the fields are whole before `code` is set
  PeerView view;      // kPeerTimeout waiting for a rank; else zero
  // The cycle (1, 2, ... since creation or recover()) of the launch that failed: its kernel's
  // launches done + 1 (for the barrier, between cycles: the next cycle). recover() agrees on
  // the cycles every rank completed from it (handle.cc, clean_cycles).
  uint64_t cycle;
};

// The abort word a failing rank SETs on every peer: (error code << 32) | (rank + 1).
__host__ __device__ inline uint64_t abort_value(uint32_t code, int rank) {
  return (static_cast<uint64_t>(code) << 32) | static_cast<uint32_t>(rank + 1);
}
__host__ __device__ inline int abort_rank(uint64_t word) {
  return static_cast<int>(word & 0xffffffffu) - 1;
}
__host__ __device__ inline uint32_t abort_code(uint64_t word) {
  return static_cast<uint32_t>(word >> 32);
}

#ifdef __CUDACC__
// Returns true in the one thread whose error was recorded (the first on this rank).
__device__ __forceinline__ bool record_error(ErrorRecord* rec, ErrorCode code, Phase phase,
                                             int peer, int token, uint64_t expected,
                                             uint64_t seen, What what, uint64_t cycle,
                                             const PeerView* view = nullptr) {
  if (atomicCAS(&rec->claimed, 0u, 1u) != 0u) return false;
  if (view != nullptr) rec->view = *view;
  rec->cycle = cycle;
  rec->phase = phase;
  rec->peer = peer;
  rec->token = token;
  rec->expected = expected;
  rec->seen = seen;
  rec->what = what;
  __threadfence_system();
  *reinterpret_cast<volatile uint32_t*>(&rec->code) = static_cast<uint32_t>(code);
  __threadfence_system();
  return true;
}
#endif

}  // namespace jmc
