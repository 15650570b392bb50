// LL ("low latency") units: data that carries its own arrival flag, so no sender fences.
//
// Why: a release store at system scope (st.release.sys, MEMBAR.SYS + the store) is what a
// sender pays to publish rows behind a flag, and the timeline of a 1-token cycle (8 ranks under
// MPS on one H100, d2745f9) shows ~2.3-3.2 us between "worked" and "end" in every phase that
// ends with one, 0.2 us in the one that does not. NCCL's LL protocol avoids the fence: each
// 4 data bytes travel next to a 4-byte flag. Here every 8-byte unit is {data, tag} written
// with ONE aligned 64-bit store and read with one 64-bit load: an aligned scalar access of up
// to 8 bytes is single-copy atomic in the PTX memory model, so a reader that sees the tag has
// the data beside it, whatever order the units land in. (NCCL stores two such units with one
// v4.u32 store, which the model treats as four separate 32-bit accesses: it relies on the
// hardware. Scalar accesses cost twice the instructions and nothing else: the same registers
// hold the same bytes in flight.) The cost: twice the bytes, nothing at decode sizes (a V2-Lite
// fp8 record is ~2.2 KB).
//
// The tag is the cycle's epoch folded into [1, 2^32 - 1]: consecutive cycles differ, and a
// zeroed unit (creation, recover()) is never a cycle's. A stale unit passes only if its slot was
// last written a multiple of 2^32 - 1 cycles before (years at decode rates; as NCCL's 32-bit
// LL flags).
//
// Used by direct handles that opt in (JMC_LL=1, handle.cc; kernels.h Path::kDirectLL):
// dispatch_send writes records and combine_send rows as LL units into the receiver's LL areas
// (layout.h, twice the plain bytes at the same places); the receiving warp unpacks what it
// reads into the plain area first (warp_unpack_ll), so everything after is the plain path's
// code. Acknowledgements are unchanged: a sender still waits until the receiver has read the
// previous cycle's units before it overwrites them.
#pragma once

#include <cstdint>

#include "core/layout.h"  // ll_tag
#include "core/memory.cuh"
#include "core/vec.cuh"

namespace jmc {
namespace {

// Relaxed 8-byte accesses at system scope (volatile: never cached in L1, as NCCL's LL polls).
__device__ __forceinline__ uint64_t ld_volatile_u64(const void* p) {
  uint64_t v;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ void st_volatile_u64(void* p, uint64_t v) {
  asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(p), "l"(v));
}

// One LL unit: 4 data bytes (low half) beside the tag (high half).
__device__ __forceinline__ void st_ll_unit(uint8_t* at, int data, uint32_t tag) {
  st_volatile_u64(at, (static_cast<uint64_t>(tag) << 32) | static_cast<uint32_t>(data));
}

// The four LL units (32 bytes) of one 16-byte data vector.
__device__ __forceinline__ void st_ll_vec(uint8_t* dst_ll, int4 v, uint32_t tag) {
  st_ll_unit(dst_ll, v.x, tag);
  st_ll_unit(dst_ll + 8, v.y, tag);
  st_ll_unit(dst_ll + 16, v.z, tag);
  st_ll_unit(dst_ll + 24, v.w, tag);
}

// A data vector's four units as loaded: arrived when every unit carries the tag.
struct LlVec {
  uint64_t u[4];
  __device__ __forceinline__ void load(const uint8_t* src_ll) {
#pragma unroll
    for (int i = 0; i < 4; ++i) u[i] = ld_volatile_u64(src_ll + 8 * i);
  }
  __device__ __forceinline__ bool arrived(uint32_t tag) const {
    return static_cast<uint32_t>(u[0] >> 32) == tag && static_cast<uint32_t>(u[1] >> 32) == tag &&
           static_cast<uint32_t>(u[2] >> 32) == tag && static_cast<uint32_t>(u[3] >> 32) == tag;
  }
  __device__ __forceinline__ int4 data() const {
    return make_int4(static_cast<int>(u[0]), static_cast<int>(u[1]), static_cast<int>(u[2]),
                     static_cast<int>(u[3]));
  }
};

// The whole warp writes `bytes` (a multiple of 16) from src as LL units at dst_ll (2 * bytes;
// a peer's memory through the peer table). src == nullptr: zeros. Loads first, as warp_copy.
// Not inlined (as warp_unpack_ll): inlined, the LL kernels spilled 120-544 bytes at sm_90.
__device__ __noinline__ void warp_copy_ll(uint8_t* dst_ll, const void* src, uint32_t bytes,
                                          uint32_t tag, int lane) {
  const auto* s = static_cast<const int4*>(src);
  const uint32_t n = bytes / kVecBytes;
  for (uint32_t i = lane; i < n; i += kCopyUnroll * 32) {
    int4 v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u)
      if (i + u * 32 < n) v[u] = s != nullptr ? s[i + u * 32] : make_int4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u)
      if (i + u * 32 < n) st_ll_vec(dst_ll + 2 * kVecBytes * (i + u * 32), v[u], tag);
  }
}

// What warp_unpack_ll saw (warp-uniform): every word arrived, or a wait gave up, and then the
// lowest range that some lane gave up on (which peer to name).
enum class LlWait { kArrived, kTimedOut, kAborted };
struct LlResult {
  LlWait wait;
  int range;
};

// The whole warp waits for the LL units of `slots` ranges and writes their data out plainly:
// range j (bit j of `mask` set; j < 32) is `bytes` (a multiple of 16) at dst + j * stride,
// read from src_ll + j * 2 * stride. All ranges' loads are in flight together (kCopyUnroll per
// lane), then each lane re-polls only the units that had not arrived. Bounded: gives up at
// `deadline` or when the abort word is set, like wait_ge. The caller orders the plain data
// for the warp (__syncwarp) before reading it.
__device__ __noinline__ LlResult warp_unpack_ll(const uint64_t* abort_word, uint8_t* dst,
                                              const uint8_t* src_ll, uint32_t stride,
                                              uint32_t mask, int slots, uint32_t bytes,
                                              uint32_t tag, uint64_t deadline, int lane) {
  const uint32_t per_slot = bytes / kVecBytes;
  const uint32_t n = per_slot * static_cast<uint32_t>(slots);
  // Data vector v: range v / per_slot, its place in the plain area (the LL one is twice it).
  auto wanted = [&](uint32_t v) { return v < n && ((mask >> (v / per_slot)) & 1u); };
  auto plain_offset = [&](uint32_t v) {
    const uint32_t j = v / per_slot;
    return static_cast<size_t>(j) * stride + static_cast<size_t>(v - j * per_slot) * kVecBytes;
  };
  LlWait result = LlWait::kArrived;
  int gave_up_on = 0x7fffffff;
  for (uint32_t i = lane; i < n && result == LlWait::kArrived; i += kCopyUnroll * 32) {
    LlVec v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u)
      if (wanted(i + u * 32)) v[u].load(src_ll + 2 * plain_offset(i + u * 32));
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const uint32_t at = i + u * 32;
      if (!wanted(at)) continue;
      while (result == LlWait::kArrived && !v[u].arrived(tag)) {
        if (ld_relaxed_sys_u64(abort_word) != 0) {
          result = LlWait::kAborted;
        } else if (globaltimer_ns() > deadline) {
          result = LlWait::kTimedOut;
        } else {
          __nanosleep(20);
          v[u].load(src_ll + 2 * plain_offset(at));
        }
      }
      if (result == LlWait::kArrived) {
        *reinterpret_cast<int4*>(dst + plain_offset(at)) = v[u].data();
      } else if (gave_up_on == 0x7fffffff) {
        gave_up_on = static_cast<int>(at / per_slot);
      }
    }
  }
  // One verdict for the warp: an abort seen by any lane wins over a timeout.
  LlResult r{LlWait::kArrived, __reduce_min_sync(0xffffffffu, gave_up_on)};
  if (__any_sync(0xffffffffu, result == LlWait::kAborted)) {
    r.wait = LlWait::kAborted;
  } else if (__any_sync(0xffffffffu, result == LlWait::kTimedOut)) {
    r.wait = LlWait::kTimedOut;
  }
  return r;
}

}  // namespace
}  // namespace jmc
