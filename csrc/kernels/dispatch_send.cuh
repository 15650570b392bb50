// dispatch_send: put each of this rank's tokens, once, to every rank that holds one of its
// experts. It waits only for the receivers' acknowledgement of the previous cycle.
//
// 1. Inputs (this rank): x [max_m, H], x_scale [max_m, S] (fp8 only), indices [max_m, k]
//    (repeated experts already -1), weights [max_m, k] (optional), num_tokens (device scalar).
//    Output: none (a ticket).
// 2. Destinations. A token's experts on rank r are sent by the member of the token's DP group
//    with r % dp == rank % dp, so this rank sends to the G ranks d_g = g * dp + rank % dp and
//    each receiver gets one copy per DP group. Receivers index our records by my_group.
// 3. Symmetric memory, epoch e = this launch's cycle:
//      local  dispatch_ack[d_g]           waited >= e - 1: d_g has read our cycle e - 1 records,
//                                         so its slots and our staged copies are free again.
//      on d_g recv_records[my_group][i]   the record (header, payload, scales),
//             dispatch_count[my_group]    SET count_word(e, records sent to d_g) (layout.h),
//                                         by the last block.
// 4. Work items are (token t, destination g) pairs, t < num_tokens, strided over all warps of
//    the grid, so one token's copies travel in parallel. A pair whose token has no expert on
//    d_g is skipped. The warp takes a slot (atomicAdd on the destination's send count: in
//    shared memory when the grid is one block, else in scratch) and writes the record:
//      - d_g reachable by load/store (peer_ptr != nullptr): straight into the peer's
//        recv_records with 16-byte stores, and no flag: the count's release covers them;
//      - otherwise (staged: a peer on another node, or KernelTuning(transport="staged")) into
//        send_records[g][slot] (symmetric), so a destination's records lie in slot order.
// 5. The last block sends each staged destination's records in ONE block-wide put (to its
//    recv_records[my_group][0..count)), then publishes every count, re-arms the send counts
//    and advances the epoch: two messages per staged destination and cycle (the put, the
//    count behind nvshmem_fence), where a put and a flag per record made two per token (what
//    makes a CPU-proxy transport like IBRC or EFA slow). A count's release store (load/store
//    peers) comes after every block's records (block barrier, and across blocks the ticket's
//    fences), so a receiver that acquired the count sees all of them.
// 6. Errors: an expert id outside [-1, E) or num_tokens outside [0, max_m] is recorded and
//    broadcast (abort word); on a poisoned handle the kernel sends nothing.
#pragma once

#include "core/protocol.cuh"
#include "core/vec.cuh"

namespace jmc {
namespace {

// Header, payload and scales of token t, written by the whole warp to `rec`. Every load is
// issued before the stores (the first 32 slots' expert and weight, the scales, the payload):
// one round trip for the record where index, payload and scales were one each.
__device__ __forceinline__ void write_record(const DispatchSendParams& p, uint8_t* rec, int t,
                                             int lane) {
  const Shape& s = p.c.shape;
  const RecordLayout& r = p.c.sym.record;
  const int k = s.experts_per_token;
  int32_t* header = reinterpret_cast<int32_t*>(rec);
  float* header_weights = reinterpret_cast<float*>(header + 1 + k);
  const size_t slots = static_cast<size_t>(t) * k;
  const int e0 = lane < k ? p.indices[slots + lane] : -1;
  const float w0 = lane < k && p.weights ? p.weights[slots + lane] : 0.0f;
  const float* scales = p.x_scale ? p.x_scale + static_cast<size_t>(t) * s.num_scales : nullptr;
  const ScalesAhead ahead = scales ? load_scales_ahead(scales, s.num_scales, lane) : ScalesAhead{};
  warp_copy(rec + r.header_bytes, p.x + static_cast<size_t>(t) * r.payload_bytes,
            r.payload_bytes, lane);
  if (lane == 0) header[0] = t;
  if (lane < k) {
    header[1 + lane] = (e0 >= 0 && e0 < s.num_experts) ? e0 : -1;
    header_weights[lane] = w0;
  }
  for (int j = lane + kWarpSize; j < k; j += kWarpSize) {  // k > 32: the rest, in turn
    const int e = p.indices[slots + j];
    header[1 + j] = (e >= 0 && e < s.num_experts) ? e : -1;
    header_weights[j] = p.weights ? p.weights[slots + j] : 0.0f;
  }
  if (scales)
    store_scales(ahead, reinterpret_cast<float*>(rec + r.header_bytes + r.payload_bytes), scales,
                 s.num_scales, lane);
}

template <unsigned kPath>  // kernels.h: kDirectOnly or kStagedOnly
__device__ __forceinline__ void dispatch_send_body(const DispatchSendParams& p) {
  const CommonParams& c = p.c;
  const Shape& s = c.shape;
  const SymmetricLayout& sym = c.sym;
  const Warps w;
  stamp_start(c, kDispatchSendKernel);
  const int k = s.experts_per_token, L = s.num_local_experts();
  const int G = s.num_dp_groups(), dp = s.dp_size;
  const int my_group = c.rank / dp, my_member = c.rank % dp;
  __shared__ uint32_t block_send_count[kMaxBlockCounters];
  const bool one_block = gridDim.x == 1 && G <= kMaxBlockCounters;
  uint32_t* send_count = one_block ? block_send_count : c.scratch.send_count;
  if (one_block)
    for (int g = threadIdx.x; g < G; g += blockDim.x) block_send_count[g] = 0;

  // The previous cycle's acknowledgements (warp 0, a lane per destination) are loaded with the
  // launch words and the token count: one round trip for all where they are already there.
  int num_tokens = *p.num_tokens;
  const LaunchWords words = load_launch_words(c, kDispatchSendKernel);
  const bool ack_lane = threadIdx.x < kWarpSize && threadIdx.x < G;
  const uint64_t first_ack =
      ack_lane ? ld_acquire_sys_u64(&sym.dispatch_ack[threadIdx.x * dp + my_member]) : 0;
  uint64_t epoch = 0;
  bool ok = !refused_at_start(c, kDispatchSendKernel, kPhaseDispatchSend, words, &epoch);
  if (ok && (num_tokens < 0 || num_tokens > s.max_num_tokens)) {
    if (blockIdx.x == 0 && threadIdx.x == 0)
      fail(c, kBadNumTokens, kPhaseDispatchSend, -1, -1, s.max_num_tokens,
           static_cast<uint64_t>(num_tokens), kWhatNone);
    ok = false;
  }

  // Step 1: every destination has read our previous cycle's records (warp 0 of each block).
  if (ok && threadIdx.x < kWarpSize) {
    for (int g = w.lane; g < G; g += kWarpSize) {
      if (g == w.lane && first_ack >= epoch - 1) continue;  // loaded above: already there
      const int dst = g * dp + my_member;
      uint64_t seen = 0;
      const Wait r = wait_ge<may_stage(kPath)>(c, &sym.dispatch_ack[dst], epoch - 1, &seen);
      ok &= check_wait(c, r, kPhaseDispatchSend, dst, -1, epoch - 1, seen, kWhatAck);
    }
  }
  ok = __syncthreads_and(ok);
  stamp_mark(c, kDispatchSendKernel, kWaited);

  // Step 2: one record per (token, destination) pair that has an expert there.
  const int items = ok ? num_tokens * G : 0;
  for (int i = w.warp; i < items; i += w.total) {
    const int t = i / G, g = i % G;
    const int dst = g * dp + my_member;
    const int32_t* ids = p.indices + static_cast<size_t>(t) * k;
    bool routed = false;
    for (int j = w.lane; j < k; j += kWarpSize) {
      const int e = ids[j];
      if (e < -1 || e >= s.num_experts) {
        if (g == 0)
          fail(c, kBadExpertIndex, kPhaseDispatchSend, -1, t, s.num_experts,
               static_cast<uint64_t>(static_cast<int64_t>(e)), kWhatNone);
      } else if (e >= 0 && e / L == dst) {
        routed = true;
      }
    }
    if (!__any_sync(0xffffffffu, routed)) continue;
    int slot = 0;
    if (w.lane == 0) slot = static_cast<int>(atomicAdd(&send_count[g], 1u));
    slot = __shfl_sync(0xffffffffu, slot, 0);
    uint8_t* rec = sym.recv_record(my_group, slot);
    uint8_t* direct = peer_ptr(c, rec, dst);
    // Load/store: straight into the peer, published by the count. Staged: packed in slot
    // order, sent with the destination's other records in one put (step 3).
    write_record(p, direct ? direct : sym.send_record(g, slot), t, w.lane);
  }

  // Step 3: the last block publishes the per-destination counts and closes the launch. The
  // abort word is read before the block barrier, so its load overlaps the other warps' work.
  const bool publish = ok && !poisoned(c);  // (a refused launch publishes nothing)
  if (!is_last_block(c, kDispatchSendKernel)) return;
  // One verdict for the whole block: its threads read the abort word at different times, and
  // a block-wide put that only some threads enter traps (an illegal instruction, seen under
  // compute-sanitizer when a bad expert index poisoned the handle mid-launch).
  const bool publish_all = __syncthreads_and(publish);
  // Each staged destination's records: one put, whole block.
  if (may_stage(kPath) && publish_all && sym.staged()) {
    for (int g = 0; g < G; ++g) {
      const int dst = g * dp + my_member;
      const uint32_t count = send_count[g];  // every block's slots are in (is_last_block)
      if (count == 0 || peer_ptr(c, sym.abort_word, dst) != nullptr) continue;
      nvshmemx_putmem_nbi_block(sym.recv_record(my_group, 0), sym.send_record(g, 0),
                                static_cast<size_t>(count) * sym.record.bytes, dst);
      if (threadIdx.x == 0) count_staged(c, kDispatchSendKernel, 1);
    }
    __syncthreads();  // every put issued before any count's fence (set_flag)
  }
  for (int g = threadIdx.x; g < G; g += blockDim.x) {
    const uint32_t count = one_block ? send_count[g] : atomicExch(&send_count[g], 0u);
    if (publish_all)
      set_flag<may_stage(kPath)>(c, &sym.dispatch_count[my_group],
                                 count_word(epoch, count, s.max_num_tokens), g * dp + my_member,
                                 kDispatchSendKernel);
  }
  finish_launch(c, kDispatchSendKernel, epoch);
}

}  // namespace
}  // namespace jmc
