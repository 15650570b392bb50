// dispatch_recv: take every DP group's records as they land and lay them out per local expert.
//
// 1. Outputs: expert_x, expert_x_scale (fp8), expert_weights f32 and row_source
//    (pack_source(group, token, slot)) per row, expert_num_tokens [L], dropped_rows [1].
//    With p.dequantize (fp8 only) expert_x is bf16 (payload times scales) and no scales.
//    Padded (Shape::packed_rows == 0): [L, P, ...], expert e's rows at e * P, P the
//    per-expert capacity (expert_rows; R = max_m * G, the worst case, by default); rows past
//    the count are undefined. Packed: [C, ...] with C = packed_rows, expert 0's rows, then
//    1's, ... (expert_first: a prefix over the local experts' row totals), rows past
//    sum(counts) undefined. A row past a capacity (packed position >= C; padded row >= P) is
//    not written (x, scales, weight) but its source is (row_source_entries(): packed at its
//    own position, padded after the L * P rows, at L * P + expert_first[e] + row - P, where
//    expert_first is then a prefix over the experts' overflows), and dropped_rows says how
//    many (combine_send answers their slots with zeros).
// 2. Symmetric memory, epoch e: local dispatch_count[g], recv_records[g][i]
//    (written by the sender of group g, s_g = g * dp + rank % dp); on s_g: dispatch_ack[rank].
// 3. Step 1, every block: one thread per group waits (bounded) for dispatch_count[g] to carry
//    epoch e (count_word, core/layout.h); its record count n_g is how many records come. A
//    prefix over the groups goes to shared memory.
//    A count that times out from a load/store sender that has not started the cycle while
//    its process lives (its heartbeat) is waited for longer: a late rank, not a failed one
//    (protocol.cuh, wait_for_late_start; start_timeout_ns).
//    A sender reachable by load/store published its count after all its records (release), a
//    staged sender put its records in one put and the count behind a fence, so the count's
//    acquire (and, staged, NVSHMEM's post-wait hook in wait_ge) is all a block needs.
//    Step 1b, packed or with a per-expert capacity, every block: a thread per record reads
//    its header and counts the rows of each local expert (shared atomics); warp 0 scans them
//    (padded: their overflows past P) into expert_first [L + 1].
//    Every block reads every header (a header is ~40 bytes: 1 KB per block per 32 records),
//    since no block may wait for another (no grid barrier: blocks need not be co-resident).
//    Step 2: warps stride over all records of all groups. A warp checks the record's header
//    (token < max_m), and for each expert id that is local takes a row with atomicAdd on the
//    expert's fill count (< R, checked; in shared memory when the grid is one block, else
//    expert_fill in scratch) and copies payload, scales, weight and source.
// 4. The last block writes expert_num_tokens (the rows below the capacity), dropped_rows,
//    re-arms the fill counts, and SETs dispatch_ack[rank] = e on every s_g: our recv_records
//    may be overwritten by their next cycle. Rows past a capacity, overflow "fail": it records
//    kCapacityExceeded instead (the handle is poisoned, no ack); with "drop" it adds them to
//    DeviceState::dropped_rows.
// 5. On any failure (timeout, abort word, bad value) the error is recorded and broadcast, the
//    remaining records are skipped, no ack is sent, and on a poisoned handle every count is 0.
#pragma once

#include "core/fp8.cuh"
#include "core/protocol.cuh"
#include "core/search.cuh"
#include "core/vec.cuh"

namespace jmc {
namespace {

// Warp 0: a[0] = 0 and a[1..n] turned into their inclusive prefix sums, 32 at a time with
// shuffles (one thread walking L = 32 entries made 32 dependent shared-memory round trips).
// The caller syncs the block before and after.
__device__ __forceinline__ void warp0_prefix_in_place(uint32_t* a, int n) {
  if (threadIdx.x >= kWarpSize) return;
  const int lane = threadIdx.x;
  uint32_t before = 0;
  for (int i0 = 0; i0 < n; i0 += kWarpSize) {
    const int i = i0 + lane;
    uint32_t v = i < n ? a[i + 1] : 0;
    for (int d = 1; d < kWarpSize; d *= 2) {
      const uint32_t below = __shfl_up_sync(0xffffffffu, v, d);
      if (lane >= d) v += below;
    }
    if (i < n) a[i + 1] = before + v;
    before += __shfl_sync(0xffffffffu, v, kWarpSize - 1);
  }
  if (lane == 0) a[0] = 0;
}

// Step 1b: expert_first[e] for e <= L, over local experts [0, e) in this cycle's records: their
// rows (packed), or their rows past the per-expert capacity P (padded); every block computes
// it from the headers (see the top of this file).
__device__ __forceinline__ void count_expert_rows(const DispatchRecvParams& p,
                                                  const uint32_t* first_record, uint32_t total,
                                                  bool packed, uint32_t* expert_first) {
  const CommonParams& c = p.c;
  const Shape& s = c.shape;
  const int k = s.experts_per_token, L = s.num_local_experts(), G = s.num_dp_groups();
  const int first_expert = c.rank * L;
  for (int e = threadIdx.x; e <= L; e += blockDim.x) expert_first[e] = 0;
  __syncthreads();
  for (uint32_t i = threadIdx.x; i < total; i += blockDim.x) {
    const int g = part_of(first_record, G, i);  // the group whose records cover i
    const int32_t* ids = reinterpret_cast<const int32_t*>(
                             c.sym.recv_record(g, static_cast<int>(i - first_record[g]))) + 1;
    for (int j = 0; j < k; ++j) {
      const int e = ids[j] - first_expert;  // the same test as step 2's
      if (e >= 0 && e < L) atomicAdd(&expert_first[e + 1], 1u);
    }
  }
  __syncthreads();
  if (!packed)
    for (int e = threadIdx.x; e < L; e += blockDim.x)
      expert_first[e + 1] = max(0, static_cast<int>(expert_first[e + 1]) - s.padded_stride());
  __syncthreads();
  warp0_prefix_in_place(expert_first, L);
  __syncthreads();
}

template <unsigned kPath>  // kernels.h, PathBits: the branch families compiled in
__device__ __forceinline__ void dispatch_recv_body(const DispatchRecvParams& p) {
  const CommonParams& c = p.c;
  const Shape& s = c.shape;
  const SymmetricLayout& sym = c.sym;
  // Re-read from the parameters at each use, as before: kept in registers across the
  // body they made the general instantiation spill.
  auto packed = [&] { return path_packed(kPath, s); };
  auto can_drop = [&] { return may_drop(kPath) && s.can_drop(); };
  const Warps w;
  stamp_start(c, kDispatchRecvKernel);
  const int k = s.experts_per_token, L = s.num_local_experts(), R = s.max_recv_tokens();
  const int G = s.num_dp_groups(), dp = s.dp_size;
  const int first_expert = c.rank * L;
  __shared__ uint32_t block_fill[kMaxBlockCounters];
  const bool one_block = gridDim.x == 1 && L <= kMaxBlockCounters;
  uint32_t* fill = one_block ? block_fill : c.scratch.expert_fill;
  if (one_block)
    for (int e = threadIdx.x; e < L; e += blockDim.x) block_fill[e] = 0;

  // Step 1: how many records will each group send this cycle?
  extern __shared__ uint32_t first_record[];  // [G + 1] prefix of the groups' record counts
  uint64_t epoch = 0;
  bool ok = !refused_at_start(c, kDispatchRecvKernel, kPhaseDispatchRecv, &epoch);
  for (int g = threadIdx.x; g < G; g += blockDim.x) {
    uint32_t n = 0;
    if (ok) {
      const int sender = g * dp + c.rank % dp;
      uint64_t seen = 0;
      const uint64_t want = count_word(epoch, 0, s.max_num_tokens);
      Wait r = wait_ge<may_stage(kPath)>(c, &sym.dispatch_count[g], want, &seen);
      if (r == Wait::kTimedOut) {  // a sender that has not started the cycle may be late
        const Waited late = wait_for_late_start(c, &sym.dispatch_count[g], want, sender, epoch,
                                                seen);
        r = late.wait;
        seen = late.seen;
      }
      if (check_wait(c, r, kPhaseDispatchRecv, sender, -1, want, seen, kWhatCount)) {
        // seen >= want; more than max_m above it is a later cycle's word (no division needed)
        if (seen - want > static_cast<uint64_t>(s.max_num_tokens)) {
          fail(c, kCorruptData, kPhaseDispatchRecv, sender, -1,
               count_word(epoch, s.max_num_tokens, s.max_num_tokens), seen, kWhatCount);
        } else {
          n = static_cast<uint32_t>(seen - want);
        }
      }
    }
    first_record[g + 1] = n;
  }
  ok = __syncthreads_and(ok);  // (also orders the counts' acquires before the reads below)
  if (threadIdx.x == 0) {
    first_record[0] = 0;
    for (int g = 0; g < G; ++g) first_record[g + 1] += first_record[g];
  }
  __syncthreads();
  stamp_mark(c, kDispatchRecvKernel, kWaited);
  const uint32_t total = ok ? first_record[G] : 0;
  // Packed: where each local expert's rows start; padded with a capacity: where its dropped
  // rows' sources start past the L * P rows (after first_record in dynamic shared memory).
  const bool counted = packed() || can_drop();
  uint32_t* expert_first = counted ? first_record + G + 1 : nullptr;
  if (counted) count_expert_rows(p, first_record, total, packed(), expert_first);
  const int capacity = static_cast<int>(s.output_rows()), P = s.padded_stride();
  const int sources = static_cast<int>(s.row_source_entries());

  // Step 2: every record of every group. A refused launch reads none; a group whose count
  // failed has none (its failure is recorded and broadcast); the other groups' records are
  // complete, so reading them is safe even if a peer has aborted since.
  for (uint32_t i = w.warp; i < total; i += w.total) {
    const int g = part_of(first_record, G, i);  // the group whose records cover i
    const int slot = static_cast<int>(i - first_record[g]);
    const int sender = g * dp + c.rank % dp;
    const uint8_t* rec = sym.recv_record(g, slot);
    const int32_t* header = reinterpret_cast<const int32_t*>(rec);
    const float* header_weights = reinterpret_cast<const float*>(header + 1 + k);
    // The token and this lane's slot (expert, weight) in one round trip: the slots were
    // loaded only after the token's check, and the weight after the copies. (The scales
    // loaded here too made the split kernel spill 24 B more.)
    const int t = header[0];
    const int id0 = w.lane < k ? header[1 + w.lane] : -1;
    const float weight0 = w.lane < k ? header_weights[w.lane] : 0.0f;
    if (t < 0 || t >= s.max_num_tokens) {
      if (w.lane == 0)
        fail(c, kCorruptData, kPhaseDispatchRecv, sender, t, s.max_num_tokens, t, kWhatRecord);
      break;
    }
    // One lane per slot takes the rows of the record's local experts, all atomics in flight
    // together (one after another, a record with several local experts paid a round trip
    // each); then the warp copies the payload into each row.
    for (int j0 = 0; j0 < k; j0 += kWarpSize) {
      const int j = j0 + w.lane;
      const int e = j < k ? (j0 == 0 ? id0 : header[1 + j]) - first_expert : -1;
      int row = -1;
      if (e >= 0 && e < L) row = static_cast<int>(atomicAdd(&fill[e], 1u));
      // Packed: after the rows of the experts before e; padded: row r of expert e, or past
      // the capacity, the source's place after the L * P rows. Either way >= capacity means
      // dropped.
      // (row >= R first: more rows than any routing can make, a corrupt header; without a
      // capacity expert_first is not there to index.)
      const bool bad_row = row >= R;
      const int at = row < 0 || bad_row ? -1
                     : packed()         ? static_cast<int>(expert_first[e]) + row
                     : row < P          ? e * P + row
                                        : capacity + static_cast<int>(expert_first[e]) + row - P;
      if (bad_row || at >= sources) {
        fail(c, kCorruptData, kPhaseDispatchRecv, sender, t, bad_row ? R : sources,
             bad_row ? row : at, kWhatRow);
        row = -1;
      }
      for (uint32_t todo = __ballot_sync(0xffffffffu, row >= 0); todo != 0; todo &= todo - 1) {
        const int from = __ffs(todo) - 1;  // the lane of the next local slot
        const int out_row = __shfl_sync(0xffffffffu, at, from);
        if (out_row < capacity) {  // (past a capacity the row is dropped, its source kept)
          const uint8_t* payload = rec + sym.record.header_bytes;
          const float* scales = reinterpret_cast<const float*>(payload +
                                                               sym.record.payload_bytes);
          if (p.dequantize) {
            warp_dequantize_fp8(p.expert_x + static_cast<size_t>(out_row) * s.hidden * 2,
                                payload, scales, s.hidden, w.lane);
          } else {
            warp_copy(p.expert_x + static_cast<size_t>(out_row) * sym.record.payload_bytes,
                      payload, sym.record.payload_bytes, w.lane);
            if (p.expert_x_scale != nullptr)
              warp_copy_floats(p.expert_x_scale + static_cast<size_t>(out_row) * s.num_scales,
                               scales, s.num_scales, w.lane);
          }
          if (w.lane == from) p.expert_weights[out_row] = j0 == 0 ? weight0 : header_weights[j];
        }
        if (w.lane == from) p.row_source[out_row] = pack_source(g, t, j, s.max_num_tokens, k);
      }
    }
  }

  // Step 3: the last block publishes the counts and acknowledges every sender. The abort word
  // is read before the block barrier, overlapping the other warps' copies.
  bool healthy = ok && !poisoned(c);  // (a refused launch acknowledges nothing)
  if (!is_last_block(c, kDispatchRecvKernel)) return;
  // Rows that arrived past the capacity (0 when it is the worst case).
  const int counted_rows = counted && ok ? static_cast<int>(expert_first[L]) : 0;
  const uint32_t dropped = static_cast<uint32_t>(
      packed() ? max(0, counted_rows - capacity) : counted_rows);
  if (dropped > 0 && !s.drop_overflow) {
    if (threadIdx.x == 0 && healthy) {
      if (packed()) {
        fail(c, kCapacityExceeded, kPhaseDispatchRecv, -1, -1, capacity, counted_rows,
             kWhatRow);
      } else {
        fail(c, kCapacityExceeded, kPhaseDispatchRecv, -1, -1, P, dropped, kWhatExpertRows);
      }
    }
    healthy = false;  // the cycle failed: no counts, no acknowledgement
  }
  for (int e = threadIdx.x; e < L; e += blockDim.x) {
    const uint32_t filled = min(one_block ? fill[e] : atomicExch(&fill[e], 0u), uint32_t(R));
    // Only the rows below the capacity are in expert_x.
    const uint32_t below_capacity =
        packed() ? static_cast<uint32_t>(max(0, min(static_cast<int>(filled),
                                                       capacity - static_cast<int>(
                                                                      expert_first[e]))))
                   : min(filled, static_cast<uint32_t>(P));
    p.expert_num_tokens[e] = healthy ? static_cast<int32_t>(below_capacity) : 0;
  }
  if (threadIdx.x == 0) {
    p.dropped_rows[0] = healthy ? static_cast<int32_t>(dropped) : 0;
    // The only writer (launches on a handle are serialized). Only when something dropped:
    // the read-modify-write is a dependent load ahead of the acknowledgements below.
    if (healthy && dropped != 0) c.scratch.state->dropped_rows += dropped;
  }
  if (healthy) {
    for (int g = threadIdx.x; g < G; g += blockDim.x)
      set_ack<may_stage(kPath)>(c, &sym.dispatch_ack[c.rank], epoch, g * dp + c.rank % dp,
                        kDispatchRecvKernel);
  }
  finish_launch(c, kDispatchRecvKernel, epoch);
}

}  // namespace
}  // namespace jmc
