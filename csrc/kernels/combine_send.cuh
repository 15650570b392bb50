// combine_send: put each expert output row back to its token's home rank(s). It waits only for
// the home ranks' acknowledgement of the previous cycle.
//
// 1. Inputs: expert_y (bf16 or f32) laid out as dispatch_recv laid out expert_x ([L, P, H]
//    padded, [C, H] packed), expert_num_tokens [L], row_source and dropped_rows [1] from
//    dispatch_recv (possibly of another handle of the same shape and layout: the backward pass
//    uses the forward's routing). Output: none (a ticket).
// 2. Symmetric memory, epoch e:
//      local combine_ack[h]          waited >= e - 1 for every rank h: h has read the rows we
//                                    put in cycle e - 1, so its combine_rows and our staged
//                                    copies are free. This is also the gate that keeps a DP
//                                    member's rows safe while it still reads (issue 9 case 1).
//      on h  combine_rows[t][j]      the row of slot (t, j) of one of h's tokens,
//            combine_flag[t][j]      SET e after the row's bytes.
// 3. Work items are the filled rows of all local experts, numbered through a prefix of
//    expert_num_tokens in shared memory (packed: row i is expert_y row i), then the rows
//    dropped past a capacity (their sources at row_source[output_rows() + d], d < dropped:
//    packed, output_rows() = C), strided over every warp. A dropped row's slot gets a zero row: its home rank waits for every
//    slot it routed, and a dropped expert adds nothing, as if its output were zero. A row's
//    source (group g, token t, slot j) is checked; the row goes to every member
//    h = g * dp + m of the group:
//      - h reachable by load/store (peer_ptr): 16-byte stores from expert_y straight into h's
//        combine_rows, then __syncwarp, fence.sys, flag store;
//      - otherwise (staged: another node, or KernelTuning(transport="staged")) packed with a
//        16-byte (token, slot) header behind h's other rows in combine_out[h] (symmetric;
//        XLA's expert_y may be reused before a network put has read it; a slot from an
//        atomicAdd on home_fill[h], in shared memory when the grid is one block).
// 4. The last block puts each staged home its packed rows in ONE block-wide put (into
//    combine_in[rank] there), then SETs combine_count[rank] = count_word(e, rows, cap) on it
//    behind a fence: two messages per staged home and cycle, where a put and a flag per row
//    made two per row. Load/store homes get no count: they know from their own indices which
//    slots come back. Then it advances the epoch.
// 5. Errors: a count outside [0, R], counts over the rows expert_y holds, a dropped count
//    that does not fit the layout, or a source out of range is recorded and broadcast.
#pragma once

#include "core/protocol.cuh"
#include "core/search.cuh"
#include "core/vec.cuh"

namespace jmc {
namespace {

template <unsigned kPath>  // kernels.h, PathBits: the branch families compiled in
__device__ __forceinline__ void combine_send_body(const CombineSendParams& p) {
  const CommonParams& c = p.c;
  const Shape& s = c.shape;
  const SymmetricLayout& sym = c.sym;
  auto staged = [&] { return may_stage(kPath) && sym.staged(); };
  // Re-read from the parameters at each use, as before: kept in registers across the
  // body they made the general instantiation spill.
  auto packed = [&] { return path_packed(kPath, s); };
  auto can_drop = [&] { return may_drop(kPath) && s.can_drop(); };
  const Warps w;
  stamp_start(c, kCombineSendKernel);
  const int k = s.experts_per_token, L = s.num_local_experts(), R = s.max_recv_tokens();
  const int G = s.num_dp_groups(), dp = s.dp_size;
  __shared__ uint32_t block_home_fill[kMaxBlockCounters];
  const bool one_block = gridDim.x == 1 && s.world_size <= kMaxBlockCounters;
  uint32_t* home_fill = one_block ? block_home_fill : c.scratch.home_fill;
  if (one_block && staged())
    for (int h = threadIdx.x; h < s.world_size; h += blockDim.x) block_home_fill[h] = 0;

  // Step 1: every home rank has read our previous cycle's rows.
  // The previous cycle's acknowledgements (warp 0, a lane per home rank) are loaded with the
  // launch words: one round trip for both where they are already there.
  const LaunchWords words = load_launch_words(c, kCombineSendKernel);
  const bool ack_lane = threadIdx.x < kWarpSize && threadIdx.x < s.world_size;
  const uint64_t first_ack = ack_lane ? ld_acquire_sys_u64(&sym.combine_ack[threadIdx.x]) : 0;
  uint64_t epoch = 0;
  bool ok = !refused_at_start(c, kCombineSendKernel, kPhaseCombineSend, words, &epoch);
  if (ok && threadIdx.x < kWarpSize) {
    for (int h = w.lane; h < s.world_size; h += kWarpSize) {
      if (h == w.lane && first_ack >= epoch - 1) continue;  // loaded above: already there
      uint64_t seen = 0;
      const Wait r = wait_ge<may_stage(kPath)>(c, &sym.combine_ack[h], epoch - 1, &seen);
      ok &= check_wait(c, r, kPhaseCombineSend, h, -1, epoch - 1, seen, kWhatAck);
    }
  }
  ok = __syncthreads_and(ok);
  stamp_mark(c, kCombineSendKernel, kWaited);

  // Step 2: rows of all experts numbered through a prefix of the counts.
  // Warp 0 loads 32 counts at a time and scans them with shuffles: one thread walking L = 32
  // counts made 32 dependent loads (R1: L = 32), ~0.3 us each under MPS. A count outside
  // [0, R], or counts that add up to more rows than a rank can hold (a corrupt or foreign
  // expert_num_tokens), are refused at once: sending part of the rows would leave home ranks
  // waiting for rows that never come (a timeout 30 s later, naming the wrong thing).
  extern __shared__ int first_row[];  // [L + 1]; first_row[L] < 0: refused
  __shared__ int num_dropped;          // rows dropped past a capacity, answered with zeros
  const int capacity = static_cast<int>(s.output_rows());
  if (threadIdx.x < kWarpSize) {
    const int max_rows = packed() ? capacity : s.max_recv_rows();
    const int per_expert = packed() ? R : s.padded_stride();  // the most rows of one expert
    const int dropped = *p.dropped_rows;  // (issued early: it overlaps the counts' loads)
    int before = 0;  // rows of experts [0, e0)
    bool refused = false;
    for (int e0 = 0; e0 < L; e0 += kWarpSize) {
      const int e = e0 + w.lane;
      const int count = e < L ? p.expert_num_tokens[e] : 0;
      const bool out_of_range = count < 0 || count > per_expert;
      int n = out_of_range ? 0 : count;
      for (int d = 1; d < kWarpSize; d *= 2) {  // inclusive prefix over the lanes
        const int below = __shfl_up_sync(0xffffffffu, n, d);
        if (w.lane >= d) n += below;
      }
      const bool too_many = before + n > max_rows;
      if ((out_of_range || too_many) && ok && blockIdx.x == 0)  // (refused: report nothing)
        fail(c, kCorruptData, kPhaseCombineSend, -1, -1, out_of_range ? per_expert : max_rows,
             out_of_range ? count : before + n, kWhatExpertCount);
      refused |= __any_sync(0xffffffffu, out_of_range || too_many);
      if (e < L) first_row[e + 1] = before + n;
      before += __shfl_sync(0xffffffffu, n, kWarpSize - 1);
    }
    // Rows drop only under a capacity; packed, only past a full expert_y (the counts fill C);
    // kept and dropped rows are at most the rows that can arrive (the staging rows' bound).
    const int most_dropped = s.max_recv_rows() - (packed() ? capacity : before);
    const bool bad_drop = dropped != 0 &&
                          (!can_drop() || dropped < 0 || dropped > most_dropped ||
                           (packed() && before != capacity));
    if (bad_drop && !refused && ok && blockIdx.x == 0 && w.lane == 0)
      fail(c, kCorruptData, kPhaseCombineSend, -1, -1, most_dropped, dropped, kWhatExpertCount);
    if (w.lane == 0) {
      first_row[0] = 0;
      if (refused || bad_drop) first_row[L] = -1;
      num_dropped = bad_drop ? 0 : dropped;
    }
  }
  __syncthreads();
  const int live = ok ? max(first_row[L], 0) : 0;
  const int rows = live + (ok && first_row[L] >= 0 ? num_dropped : 0);
  for (int i = w.warp; i < rows; i += w.total) {
    // A dropped row's source: after the output rows (packed: at i itself, live == C then).
    int at = i < live ? i : capacity + (i - live);
    if (!packed() && i < live) {
      const int e = part_of(first_row, L, i);  // the expert whose rows cover i
      at = e * s.padded_stride() + (i - first_row[e]);
    }
    const int src = p.row_source[at];
    const int j = src % k, t = (src / k) % s.max_num_tokens, g = src / k / s.max_num_tokens;
    if (src < 0 || g >= G) {
      if (w.lane == 0) fail(c, kCorruptData, kPhaseCombineSend, -1, -1, G, src, kWhatRow);
      break;
    }
    // nullptr: a dropped row, sent as zeros.
    const uint8_t* y_row =
        i < live ? p.expert_y + static_cast<size_t>(at) * sym.combine_row_bytes : nullptr;
    uint8_t* row = sym.combine_row(t, j);
    uint64_t* flag = sym.slot_flag(t, j);
    bool sent = true;
    for (int m = 0; m < dp; ++m) {
      const int home = g * dp + m;
      uint8_t* direct = peer_ptr(c, row, home);
      if (!staged() || direct != nullptr) {  // (every peer is load/store when not staged)
        if (y_row != nullptr) {
          warp_copy(direct, y_row, sym.combine_row_bytes, w.lane);
        } else {
          warp_zero(direct, sym.combine_row_bytes, w.lane);
        }
        __syncwarp();
        if (w.lane == 0) st_release_sys_u64(peer_ptr(c, flag, home), epoch);
        continue;
      }
      // Staged home: packed behind its other rows, sent with them in one put (step 3).
      int n = 0;
      if (w.lane == 0) n = static_cast<int>(atomicAdd(&home_fill[home], 1u));
      n = __shfl_sync(0xffffffffu, n, 0);
      if (n >= sym.combine_cap) {  // more rows for one home than its tokens have slots here
        if (w.lane == 0)
          fail(c, kCorruptData, kPhaseCombineSend, home, t, sym.combine_cap, n, kWhatRow);
        sent = false;
        break;
      }
      uint8_t* entry = sym.out_entry(home, n);
      if (w.lane == 0) {
        reinterpret_cast<int32_t*>(entry)[0] = t;
        reinterpret_cast<int32_t*>(entry)[1] = j;
      }
      if (y_row != nullptr) {
        warp_copy(entry + kEntryHeaderBytes, y_row, sym.combine_row_bytes, w.lane);
      } else {
        warp_zero(entry + kEntryHeaderBytes, sym.combine_row_bytes, w.lane);
      }
    }
    if (!sent) break;
  }

  // Step 3: the last block sends each staged home its packed rows in ONE block-wide put, then
  // the count behind a fence (set_flag), and closes the launch. The verdict is the whole
  // block's (a block put entered by some threads only traps; see dispatch_send), and it reads
  // the abort word after the ticket, whose fences make every block's fail() visible (a rank
  // that refused its counts or overflowed a home must send nothing: a count past cap would
  // be a put past the home's combine_in). Load/store-only handles skip the read.
  if (!is_last_block(c, kCombineSendKernel)) return;
  if (staged()) {
    const bool publish_all = __syncthreads_and(ok && !poisoned(c));
    if (publish_all) {
      for (int h = 0; h < s.world_size; ++h) {
        const uint32_t count = home_fill[h];  // every block's rows are in (is_last_block)
        if (count == 0 || count > static_cast<uint32_t>(sym.combine_cap) ||
            peer_ptr(c, sym.abort_word, h) != nullptr)
          continue;
        nvshmemx_putmem_nbi_block(sym.in_entry(c.rank, 0), sym.out_entry(h, 0),
                                  static_cast<size_t>(count) * sym.combine_entry_bytes, h);
        if (threadIdx.x == 0) count_staged(c, kCombineSendKernel, 1);
      }
      __syncthreads();  // every put issued before any count's fence
    }
    for (int h = threadIdx.x; h < s.world_size; h += blockDim.x) {
      const uint32_t count = one_block ? home_fill[h] : atomicExch(&home_fill[h], 0u);
      if (publish_all && count <= static_cast<uint32_t>(sym.combine_cap) &&
          peer_ptr(c, sym.abort_word, h) == nullptr)
        set_flag<may_stage(kPath)>(c, &sym.combine_count[c.rank], count_word(epoch, count, sym.combine_cap), h,
                 kCombineSendKernel);
    }
  }
  finish_launch(c, kCombineSendKernel, epoch);
}

}  // namespace
}  // namespace jmc
