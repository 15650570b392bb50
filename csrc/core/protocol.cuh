// Device helpers every kernel shares: bounded waits that watch the abort word, failure
// reporting, the cycle's epoch, the last-block ticket and the timing stamps.
#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#include "core/memory.cuh"
#include "kernels/kernels.h"

namespace jmc {

constexpr int kWarpSize = 32;

// `local` (a pointer into this rank's symmetric buffer) as mapped from peer `pe`'s copy, or
// nullptr if `pe` is not reachable by load/store. From the handle's peer table (layout.h: one
// add, no global load), nvshmem_ptr for peers past it.
template <typename T>
__device__ __forceinline__ T* peer_ptr(const CommonParams& c, T* local, int pe) {
  if (pe >= kMaxPeerTable) return static_cast<T*>(nvshmem_ptr(local, pe));
  uint8_t* base = c.peers.base[pe];
  if (base == nullptr) return nullptr;
  const auto offset = reinterpret_cast<const uint8_t*>(local) -
                      reinterpret_cast<const uint8_t*>(c.sym.abort_word);  // the buffer's base
  return reinterpret_cast<T*>(base + offset);
}

// SETs a 64-bit flag (count, ack, abort word, barrier flag) on `pe`, after every write and
// read this thread made or observed before. A peer reachable by load/store gets a release
// store at system scope (a count follows writes into the peer: a GPU-scope fence would not
// order them for a peer on another GPU; acks go through set_ack below). Any other peer gets a
// plain 8-byte put behind nvshmem_fence: proxy transports run signals as atomics at the
// target, which UCX cannot do without GDRCopy ("AMO 8 not supported ... GDRCopy Disabled"),
// and flags only need SET: a whole aligned word, never added to.
// A kernel that passes itself as `counted` adds the message to its staged_messages count
// when the handle counts them (CommonParams::count_staged; off unless a test asks).
__device__ __forceinline__ void count_staged(const CommonParams& c, KernelId kernel,
                                             uint64_t messages) {
  if (!c.count_staged) return;
  atomicAdd(reinterpret_cast<unsigned long long*>(&c.scratch.state->staged_messages[kernel]),
            static_cast<unsigned long long>(messages));
}

// kMayStage false (the direct instantiations, kernels.h PathBits: every peer is load/store
// reachable) compiles the NVSHMEM branch out: it was cold machine code in every hot path.
template <bool kMayStage = true>
__device__ __forceinline__ void set_flag(const CommonParams& c, uint64_t* flag, uint64_t value,
                                         int pe, int counted = -1) {
  if (uint64_t* direct = peer_ptr(c, flag, pe)) {
    st_release_sys_u64(direct, value);
  } else if (kMayStage) {  // (a direct handle's peers are all load/store: handle.cc checks)
    nvshmem_fence();  // puts to pe issued before this one land first
    nvshmem_uint64_p(flag, value, pe);
    if (counted >= 0) count_staged(c, static_cast<KernelId>(counted), 1);
  }
}

// SETs an acknowledgement (dispatch_ack, combine_ack): "I have read your data of this cycle,
// you may overwrite it". As set_flag, but a load/store peer gets a relaxed store unless the
// handle asked for release acknowledgements (JMC_ACKS=release, CommonParams::release_acks): no
// MEMBAR.SYS at the end of either receive, 2.8 us less per cycle at V2-Lite 1 token (H100,
// 07499c1). What orders it after this rank's reads of the peer's data is the hardware, not the
// PTX model: every read whose value is used (stored to an output, or deciding a branch or an
// atomic) has returned before the block barrier (and, in multi-block grids, before each
// block's ticket), and the ack is stored after it. A load whose value is discarded (a slot's
// weight that is not local, a flag re-read on success) may still be in flight: a later
// cycle's data landing under it cannot reach any output. pplx-kernels acknowledges with no
// fence at all. A violation would be a peer overwriting rows still being read: the soak worker
// checks every cycle's data.
template <bool kMayStage>
__device__ __forceinline__ void set_ack(const CommonParams& c, uint64_t* flag, uint64_t value,
                                        int pe, int counted) {
  uint64_t* direct = peer_ptr(c, flag, pe);
  if (direct != nullptr && !c.release_acks) {
    st_relaxed_sys_u64(direct, value);
  } else {
    set_flag<kMayStage>(c, flag, value, pe, counted);
  }
}

// Records the first error of this rank and tells every rank (itself included) through the
// abort word, so their waits fail fast instead of each running into its own timeout.
// Not inlined: it runs only on an error, and inlined at its ~20 call sites (the record, a
// release or an NVSHMEM put per rank), with the timeout's record, it made 23 % of the fused
// dispatch kernel's machine code (12-14 % of the combines'), cold code between the hot paths
// (docs/notes.md, 2026-12-06 evening). `c` is the kernel's parameter in place (every kernel
// takes its parameters as __grid_constant__), so the call copies nothing to the stack.
inline __device__ __noinline__ void fail(const CommonParams& c, ErrorCode code, Phase phase,
                                         int peer, int token, uint64_t expected, uint64_t seen,
                                         What what, const PeerView* view = nullptr) {
  // The failing launch's cycle: its kernel's count advances only when the launch ends
  // (finish_launch), so the count + 1; the barrier runs between cycles (the next one).
  int kernel = kCombineRecvKernel;
  switch (phase) {
    case kPhaseDispatchSend: kernel = kDispatchSendKernel; break;
    case kPhaseDispatchRecv: kernel = kDispatchRecvKernel; break;
    case kPhaseCombineSend: kernel = kCombineSendKernel; break;
    default: break;
  }
  const uint64_t cycle =
      *reinterpret_cast<volatile uint64_t*>(&c.scratch.state->epoch[kernel]) + 1;
  if (!record_error(c.error, code, phase, peer, token, expected, seen, what, cycle, view))
    return;
  if (code == kPeerAborted) return;  // the peer that failed first told everyone already
  if (code == kStaleLaunch) return;  // a closed handle: its symmetric buffer may be another's
  const uint64_t word = abort_value(code, c.rank);
  for (int pe = 0; pe < c.shape.world_size; ++pe)
    set_flag(c, c.sym.abort_word, word, pe);
}

// True once this rank or any peer reported an error on the handle: every kernel then does
// nothing (and writes empty outputs), every wait gives up. Only the abort word is read: every
// recorded error sets it on this rank too, and it lives in device memory (the pinned error
// record is host memory: a read from the GPU costs a PCIe round trip, measured to dominate).
__device__ __forceinline__ bool poisoned(const CommonParams& c) {
  return ld_relaxed_sys_u64(c.sym.abort_word) != 0;
}

// Launches of `kernel` completed on this handle (finish_launch advances it).
__device__ __forceinline__ uint64_t launches_done(const CommonParams& c, KernelId kernel) {
  return *reinterpret_cast<volatile uint64_t*>(&c.scratch.state->epoch[kernel]);
}

// Each half (dispatch, combine) is a channel: send, recv, send, ... A send needs every earlier
// send received; a recv needs exactly one send not yet received. Checked here, from the device's
// counts, and not by the handler: under XLA command buffers the handler runs once, when the
// launch is recorded, and every later replay is this kernel alone.
__device__ __forceinline__ bool launch_in_order(const CommonParams& c, KernelId kernel,
                                                uint64_t* sent, uint64_t* received) {
  const bool dispatch = kernel == kDispatchSendKernel || kernel == kDispatchRecvKernel;
  const bool is_send = kernel == kDispatchSendKernel || kernel == kCombineSendKernel;
  *sent = launches_done(c, dispatch ? kDispatchSendKernel : kCombineSendKernel);
  *received = launches_done(c, dispatch ? kDispatchRecvKernel : kCombineRecvKernel);
  return *sent - *received == (is_send ? 0u : 1u);
}

// True once close() marked the handle (DeviceState::closed: never freed, so always readable).
__device__ __forceinline__ bool handle_closed(const CommonParams& c) {
  return *reinterpret_cast<volatile uint32_t*>(&c.scratch.state->closed) != 0;
}

// What a kernel reads first: whether the handle was closed, the abort word and the launch
// counts of its half.
struct LaunchWords {
  uint64_t abort_word, sent, received;
  bool closed, in_order;
};

// Issues the loads; nothing here uses their values, so they travel together, and a caller may
// issue more loads (an acknowledgement) before refused_at_start looks at them. (On a closed
// handle the abort word is read from a symmetric buffer another handle may own now: a harmless
// read, never used.)
__device__ __forceinline__ LaunchWords load_launch_words(const CommonParams& c, KernelId kernel) {
  LaunchWords l;
  l.closed = handle_closed(c);
  l.abort_word = ld_relaxed_sys_u64(c.sym.abort_word);
  l.in_order = launch_in_order(c, kernel, &l.sent, &l.received);
  return l;
}

// At a kernel's start: true if it must do nothing. Either the handle was closed (a stale launch
// replayed from a command buffer: recorded on this rank only, never broadcast, and the caller
// must touch no symmetric memory), or it is poisoned (a rank that learns of a peer's error only
// here records it, so that check() and the host's next call report it), or this launch is out
// of order (recorded as a ProtocolError and broadcast: the cycle is broken for every rank).
// Otherwise *epoch is this launch's cycle (one more than the launches completed before it; the
// last block advances it: finish_launch). The words are loaded before any is used
// (load_launch_words): one round trip, where testing the abort word before loading the counts
// made two, and a separate epoch load a third (~0.3 us each).
__device__ __forceinline__ bool refused_at_start(const CommonParams& c, KernelId kernel,
                                                 Phase phase, const LaunchWords& l,
                                                 uint64_t* epoch) {
  const bool is_send = kernel == kDispatchSendKernel || kernel == kCombineSendKernel;
  *epoch = (is_send ? l.sent : l.received) + 1;
  const bool reporter = blockIdx.x == 0 && threadIdx.x == 0;
  if (l.closed) {
    if (reporter) fail(c, kStaleLaunch, phase, -1, -1, 0, 0, kWhatNone);
    return true;
  }
  if (l.abort_word != 0) {
    if (reporter && *reinterpret_cast<volatile uint32_t*>(&c.error->claimed) == 0)
      fail(c, kPeerAborted, phase, abort_rank(l.abort_word), -1, abort_code(l.abort_word), 0,
           kWhatNone);
    return true;
  }
  if (l.in_order) {
    // A mark for peers whose waits on us time out (peer_view): no fence, nothing waits on it.
    if (reporter) st_relaxed_sys_u64(&c.sym.started[kernel], *epoch);
    return false;
  }
  if (reporter) fail(c, kOutOfOrder, phase, -1, -1, l.sent, l.received, kWhatNone);
  return true;
}

__device__ __forceinline__ bool refused_at_start(const CommonParams& c, KernelId kernel,
                                                 Phase phase, uint64_t* epoch) {
  return refused_at_start(c, kernel, phase, load_launch_words(c, kernel), epoch);
}

// kRecorded: the wait failed and already recorded why (wait_for_late_start); nothing to add.
enum class Wait { kArrived, kTimedOut, kAborted, kRecorded };
// A wait's outcome and the flag's value it last saw (returned in registers by an out-of-line
// wait: a pointer to the caller's variable would put it on the stack).
struct Waited {
  Wait wait;
  uint64_t seen;
};

// How many polls a wait makes between two reads of the clock. %globaltimer is not the SM's
// cycle counter: a read is a trip off the SM, and one per poll and one per kernel body (for its
// deadline) sat on the cycle's critical path (-0.2 to -0.5 us per cycle without them, c9cc5e9,
// H100). A poll is one round trip (0.3-0.6 us under MPS), so a wait gives up within its
// timeout plus up to 32 polls (16 before its first clock read, up to 16 after the deadline).
constexpr uint32_t kPollsPerClockRead = 16;

// Spins until *flag >= expected. The first load acquires: a flag that is already there (an
// acknowledgement of the previous cycle, a peer that was ahead) costs one load, not a relaxed
// load and then an acquire, and no clock read. Otherwise it polls relaxed (no L1 invalidation
// per poll), then acquires once. Each poll loads the flag and the abort word together: one
// round trip per poll (the abort word's load, then a branch on it, then the flag's made two,
// ~1.2 us under MPS, so a flag was seen ~0.6 us later on average). The timeout (c.timeout_ns)
// runs from the wait's first clock read, kPollsPerClockRead polls after its first miss: each
// wait is bounded on its own, and the first that times out sets the abort word, which ends
// every later wait of the launch at its next poll. With a peer behind a proxy transport,
// nvshmem_uint64_test then runs the transport's post-wait consistency hook (DESIGN §11; with
// only load/store peers the acquire is the whole story). Gives up at the deadline or when
// the abort word is set (a flag that arrived in the same poll wins).
template <bool kMayStage = true>  // false: no staged peer, no NVSHMEM hook (set_flag)
__device__ __forceinline__ Wait wait_ge(const CommonParams& c, const uint64_t* flag,
                                        uint64_t expected, uint64_t* seen) {
  uint64_t v = ld_acquire_sys_u64(flag);
  if (v < expected) {
    uint64_t deadline = 0;  // set at the first clock read
    for (uint32_t polls = 1;; ++polls) {
      const uint64_t aborted = ld_relaxed_sys_u64(c.sym.abort_word);
      v = ld_relaxed_sys_u64(flag);  // in flight with the abort word's load
      if (v >= expected) break;
      if (aborted != 0) {
        *seen = v;
        return Wait::kAborted;
      }
      if (polls % kPollsPerClockRead == 0) {
        const uint64_t now = globaltimer_ns();
        if (deadline == 0) {
          deadline = now + c.timeout_ns;
        } else if (now > deadline) {
          *seen = v;
          return Wait::kTimedOut;
        }
      }
      __nanosleep(20);
    }
    v = ld_acquire_sys_u64(flag);
  }
  *seen = v;
  if (kMayStage && c.sym.staged())
    nvshmem_uint64_test(const_cast<uint64_t*>(flag), NVSHMEM_CMP_GE, expected);
  return Wait::kArrived;
}

// What a wait of `phase` that timed out on `peer` needed from it (which kernel, which cycle),
// and where that peer's kernels had started (its `started` marks, read through `remote` where
// it is load/store reachable; nothing for a peer over the network), for the error record.
// Only on the timeout path, and not inlined, with scalar arguments: inlined (or handed
// CommonParams, which the call copied to the stack before the kernels took their parameters as
// __grid_constant__), the remote reads took registers from the hot loops (dispatch_recv
// spilled 112 bytes instead of 48).
inline __device__ __noinline__ void read_peer_view(const uint64_t* remote, uint32_t phase,
                                                   uint64_t expected, uint32_t what,
                                                   uint64_t bound, PeerView* v) {
  switch (phase) {  // an ack comes from the peer's recv, a count, record or row from its send
    case kPhaseDispatchSend: v->needed_kernel = kDispatchRecvKernel + 1; break;
    case kPhaseDispatchRecv: v->needed_kernel = kDispatchSendKernel + 1; break;
    case kPhaseCombineSend: v->needed_kernel = kCombineRecvKernel + 1; break;
    case kPhaseCombineRecv: v->needed_kernel = kCombineSendKernel + 1; break;
    default: return;  // the barrier: no started marks
  }
  // A count word is count_word(cycle, 0, bound); every other wait is for the cycle itself.
  v->needed_cycle = what == kWhatCount || what == kWhatRowCount ? expected / (bound + 1)
                                                                : expected;
  // Only a peer this rank can load from: a get to a peer over the network that is gone could
  // block for good (or trap on a completion error), turning a bounded timeout into a hang.
  if (remote == nullptr) {
    v->needed_kernel = 0;  // no view: the message says nothing about where the peer stood
    return;
  }
  for (int i = 0; i < kStartedKernels; ++i) v->started[i] = ld_relaxed_sys_u64(remote + i);
}

// The record of a wait that timed out, with the peer's view when the peer is a rank (`late`:
// what a wait for its start saw of its host, PeerView). Not inlined, as fail().
inline __device__ __noinline__ void fail_timed_out(const CommonParams& c, Phase phase, int peer,
                                                   int token, uint64_t expected, uint64_t seen,
                                                   What what, Late late = kLateNotWaited) {
  PeerView view{};
  if (peer >= 0 && peer < c.shape.world_size)
    read_peer_view(peer_ptr(c, c.sym.started, peer), phase, expected, what,
                   static_cast<uint64_t>(what == kWhatRowCount ? c.sym.combine_cap
                                                               : c.shape.max_num_tokens),
                   &view);
  view.late = late;
  fail(c, kPeerTimeout, phase, peer, token, expected, seen, what, &view);
}

// A late rank is not a failed one. dispatch_recv's wait for the count of `peer`'s dispatch_send
// of `cycle` timed out; if that peer has not started the cycle (its started mark is behind)
// while its process lives (its heartbeat word still changes: heartbeat.cc), it is late (a
// first-step compile, a synchronous checkpoint), so keep waiting for the count:
//   - up to c.start_timeout_ns from the wait's start (timeout_ns of it already spent);
//   - once the peer starts the cycle, the ordinary timeout_ns from then (a peer that stalls
//     mid-cycle is an error as before);
//   - kHeartbeatStaleNs after its heartbeat stops (a killed process: reported within the
//     timeout plus that), or at once when the abort word is set.
// Only for peers reachable by load/store: their marks and heartbeat are plain loads, where a
// get to a peer over the network that is gone could block for good. Others, and handles with
// start_timeout_ns <= timeout_ns, time out as before. Returns kArrived (the count acquired),
// kAborted, kTimedOut (not waited: the caller records it) or kRecorded. Not inlined: it runs
// only after a timeout, and the hot loops keep its registers.
inline __device__ __noinline__ Waited wait_for_late_start(const CommonParams& c,
                                                          const uint64_t* flag,
                                                          uint64_t expected, int peer,
                                                          uint64_t cycle, uint64_t seen) {
  // (Through the peer table alone: nvshmem_ptr inlined here took the registers a split
  // kernel's 64-register bound does not have.)
  const uint8_t* base = peer < kMaxPeerTable ? c.peers.base[peer] : nullptr;
  if (c.start_timeout_ns <= c.timeout_ns || base == nullptr) return {Wait::kTimedOut, seen};
  const auto at_peer = [&](const uint64_t* local) {
    return reinterpret_cast<const uint64_t*>(
        base + (reinterpret_cast<const uint8_t*>(local) -
                reinterpret_cast<const uint8_t*>(c.sym.abort_word)));
  };
  const uint64_t* started = at_peer(c.sym.started + kDispatchSendKernel);
  const uint64_t* beat = at_peer(c.sym.heartbeat);
  if (ld_relaxed_sys_u64(started) >= cycle) return {Wait::kTimedOut, seen};
  // Time in units of 1024 ns from here, in 32 bits (71 minutes; longer waits are cut there):
  // 64-bit clocks took the registers a split kernel's 64-register bound does not have.
  const uint64_t t0 = globaltimer_ns();
  const uint64_t budget = (c.start_timeout_ns - c.timeout_ns) >> 10;
  uint32_t give_up = budget > 0xF0000000u ? 0xF0000000u : static_cast<uint32_t>(budget);
  uint32_t last_beat = static_cast<uint32_t>(ld_relaxed_sys_u64(beat)), beat_changed_at = 0;
  bool peer_started = false;
  for (uint32_t polls = 1;; ++polls) {
    const uint64_t aborted = ld_relaxed_sys_u64(c.sym.abort_word);
    const uint64_t v = ld_relaxed_sys_u64(flag);
    if (v >= expected) return {Wait::kArrived, ld_acquire_sys_u64(flag)};
    if (aborted != 0) return {Wait::kAborted, v};
    if (polls % kPollsPerClockRead == 0) {
      const uint32_t now = static_cast<uint32_t>((globaltimer_ns() - t0) >> 10);
      if (!peer_started && ld_relaxed_sys_u64(started) >= cycle) {
        peer_started = true;
        give_up = min(give_up, now + static_cast<uint32_t>(c.timeout_ns >> 10));
      }
      const uint32_t b = static_cast<uint32_t>(ld_relaxed_sys_u64(beat));
      if (b != last_beat) {
        last_beat = b;
        beat_changed_at = now;
      }
      const bool silent = !peer_started && now - beat_changed_at > (kHeartbeatStaleNs >> 10);
      if (silent || now > give_up) {
        fail_timed_out(c, kPhaseDispatchRecv, peer, -1, expected, v, kWhatCount,
                       silent ? kLateSilent : peer_started ? kLateNotWaited : kLateAlive);
        return {Wait::kRecorded, v};
      }
    }
    __nanosleep(256);  // a long wait: no need to see the count within a poll's round trip
  }
}

// Turns a failed wait into the error record (and the abort broadcast); true if it arrived.
__device__ __forceinline__ bool check_wait(const CommonParams& c, Wait w, Phase phase, int peer,
                                           int token, uint64_t expected, uint64_t seen,
                                           What what) {
  if (w == Wait::kArrived) return true;
  if (w == Wait::kRecorded) return false;
  if (w == Wait::kTimedOut) {
    fail_timed_out(c, phase, peer, token, expected, seen, what);
  } else {
    const uint64_t word = ld_relaxed_sys_u64(c.sym.abort_word);
    fail(c, kPeerAborted, phase, abort_rank(word), -1, abort_code(word), 0, what);
  }
  return false;
}

// Lane 0 waits, the warp shares the verdict; __syncwarp orders the other lanes' later reads
// after lane 0's acquire (a shuffle alone is not an ordering edge, DESIGN §11).
__device__ __forceinline__ bool warp_wait_ge(const CommonParams& c, const uint64_t* flag,
                                             uint64_t expected, Phase phase,
                                             int peer, int token, What what) {
  const int lane = threadIdx.x % kWarpSize;
  int ok = 0;
  if (lane == 0) {
    uint64_t seen = 0;
    const Wait w = wait_ge(c, flag, expected, &seen);
    ok = check_wait(c, w, phase, peer, token, expected, seen, what);
  }
  ok = __shfl_sync(0xffffffffu, ok, 0);
  __syncwarp();
  return ok != 0;
}

__device__ __forceinline__ void stamp_start(const CommonParams& c, KernelId kernel) {
  if (c.timings != nullptr && blockIdx.x == 0 && threadIdx.x == 0)
    c.timings[start_slot(kernel)] = globaltimer_ns();
}

// A phase mark of block 0's thread 0 (kernels.h): after a block barrier, or (combine_recv) when
// warp 0 has seen token 0's rows; a mark not reached keeps whatever its sample slot held (an
// earlier timed run's stamp, or 0).
__device__ __forceinline__ void stamp_mark(const CommonParams& c, KernelId kernel, Mark mark) {
  if (c.timings != nullptr && blockIdx.x == 0 && threadIdx.x == 0)
    c.timings[mark_slot(kernel, mark)] = globaltimer_ns();
}

// Every block calls this at its end. Returns true in all threads of the last block to get
// here; by then every other block's writes are visible to it (fence before the ticket).
__device__ __forceinline__ bool is_last_block(const CommonParams& c, KernelId kernel) {
  __shared__ bool last;
  __syncthreads();
  stamp_mark(c, kernel, kWorked);
  if (gridDim.x == 1) return true;  // the fused kernels: no ticket, no fences (~1 us each)
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(&c.scratch.state->ticket[kernel], 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (last) __threadfence();
  return last;
}

// The last block closes the launch: ticket re-armed, epoch advanced, end stamp written.
__device__ __forceinline__ void finish_launch(const CommonParams& c, KernelId kernel,
                                              uint64_t epoch) {
  if (threadIdx.x == 0) {
    c.scratch.state->ticket[kernel] = 0;
    c.scratch.state->epoch[kernel] = epoch;
    if (c.timings != nullptr) c.timings[end_slot(kernel)] = globaltimer_ns();
  }
}

// Global warp numbering over the grid.
struct Warps {
  int lane, warp, total;
  __device__ __forceinline__ Warps()
      : lane(threadIdx.x % kWarpSize),
        warp((blockIdx.x * blockDim.x + threadIdx.x) / kWarpSize),
        total(gridDim.x * blockDim.x / kWarpSize) {}
};

}  // namespace jmc
