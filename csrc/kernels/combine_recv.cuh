// combine_recv: wait for every expert row of each of this rank's tokens, form the weighted sum
// in f32, write y; then tell every rank that its rows have been read.
//
// 1. Inputs: indices [max_m, k] (repeated experts already -1), weights [max_m, k] (a repeated
//    expert's weights merged on its first slot), num_tokens. Outputs: y [max_m, H] bf16, zero
//    for rows >= num_tokens; optionally slot_rows [max_m, k, H] (combine dtype): the row that
//    came back for each valid slot, zero elsewhere (the backward pass needs them).
// 2. Symmetric memory, epoch e: local combine_flag[t][j], combine_rows[t][j] (from load/store
//    senders), combine_count[s] and combine_in[s] (from staged senders: all their rows for us
//    in one put, then the count); on every rank h: combine_ack[rank] (SET e by the last block).
//    Each block first waits for every staged sender's count and maps each slot (t, j) to its
//    entry (map_staged_rows); a staged slot then needs no wait of its own.
// 3. Work items are (token, part) pairs: a token's H elements are split into P parts so that
//    every warp of the grid has work even for one token (P = warps / num_tokens, at most one
//    8-element chunk per lane per part). For a live token, lanes poll the flags of its valid
//    slots in parallel (bounded), then each lane sums 8 hidden elements at a time over the k
//    slots, y = sum_j w[t,j] * row(t, j), in f32. Slots whose expert id is -1 are never read,
//    so a NaN weight there cannot leak into y.
// 4. The last block SETs combine_ack[rank] = e on every rank: their next combine_send may
//    overwrite our combine_rows. Nothing is reset.
// 5. On a timeout or an abort the error is recorded and broadcast, no ack is sent, and every
//    remaining live row of y (t < num_tokens) is written as NaN, so a step that goes on without
//    calling check() (a replayed command buffer runs no host code) cannot take it for data;
//    rows past num_tokens stay zero. A refused launch (closed, poisoned or out of order) writes
//    NaN rows too.
#pragma once

#include <cuda_bf16.h>

#include "core/protocol.cuh"
#include "core/vec.cuh"

namespace jmc {
namespace {

constexpr int kElemsPerChunk = 8;  // one 16-byte bf16 store of y per lane per step

template <typename T>
struct Chunk;

template <>
struct Chunk<__nv_bfloat16> {
  int4 raw;
  __device__ __forceinline__ void load(const uint8_t* row, int c) {
    raw = reinterpret_cast<const int4*>(row)[c];
  }
  __device__ __forceinline__ void store(uint8_t* row, int c) const {
    reinterpret_cast<int4*>(row)[c] = raw;
  }
  __device__ __forceinline__ void zero() { raw = make_int4(0, 0, 0, 0); }
  __device__ __forceinline__ void accumulate(float w, float (&acc)[kElemsPerChunk]) const {
    const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < kElemsPerChunk / 2; ++i) {
      const float2 f = __bfloat1622float2(pairs[i]);
      acc[2 * i] += w * f.x;
      acc[2 * i + 1] += w * f.y;
    }
  }
};

template <>
struct Chunk<float> {
  float4 a, b;
  __device__ __forceinline__ void load(const uint8_t* row, int c) {
    a = reinterpret_cast<const float4*>(row)[2 * c];
    b = reinterpret_cast<const float4*>(row)[2 * c + 1];
  }
  __device__ __forceinline__ void store(uint8_t* row, int c) const {
    reinterpret_cast<float4*>(row)[2 * c] = a;
    reinterpret_cast<float4*>(row)[2 * c + 1] = b;
  }
  __device__ __forceinline__ void zero() { a = b = make_float4(0.f, 0.f, 0.f, 0.f); }
  __device__ __forceinline__ void accumulate(float w, float (&acc)[kElemsPerChunk]) const {
    acc[0] += w * a.x; acc[1] += w * a.y; acc[2] += w * a.z; acc[3] += w * a.w;
    acc[4] += w * b.x; acc[5] += w * b.y; acc[6] += w * b.z; acc[7] += w * b.w;
  }
};

// Eight bf16 quiet NaNs (0x7fc0 each): the y chunk of a token whose rows never came.
constexpr int kNaNPair = 0x7fc07fc0;
__device__ __forceinline__ int4 nan_bf16x8() {
  return make_int4(kNaNPair, kNaNPair, kNaNPair, kNaNPair);
}

__device__ __forceinline__ int4 to_bf16x8(const float (&acc)[kElemsPerChunk]) {
  int4 out;
  auto* pairs = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int i = 0; i < kElemsPerChunk / 2; ++i)
    pairs[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  return out;
}

// Slots whose chunks a lane loads at once: as many 16-byte loads as warp_copy keeps in flight
// (core/vec.cuh: 8 in the fused kernel, 4 under the split kernels' register cap).
template <typename T>
constexpr int kSlotBatch = kCopyUnroll * kVecBytes / static_cast<int>(sizeof(Chunk<T>));

// Staged senders (combine_send step 4): one thread per sender waits (bounded) for its row count
// of this cycle, then the block reads every entry's (token, slot) header and writes
// slot_map[t * k + j] = map_base + entry, map_base = epoch * (cap + 1): a whole-epoch tag, so
// neither an entry from before recover() (epochs restart) nor one 2^32 cycles old passes. A header that names a slot whose expert is not on
// that sender is recorded as CorruptData (never written out of bounds). Every thread of the
// block calls it (block barriers inside); `active` false (a refused launch): it waits for
// nothing. Returns the block's verdict.
__device__ __forceinline__ bool map_staged_rows(const CombineRecvParams& p, bool active,
                                             uint64_t epoch, uint64_t* slot_map,
                                             uint64_t map_base) {
  const CommonParams& c = p.c;
  const Shape& s = c.shape;
  const SymmetricLayout& sym = c.sym;
  const int k = s.experts_per_token, L = s.num_local_experts();
  __shared__ uint32_t rows_from[kMaxBlockCounters];  // world <= kMaxBlockCounters (handle.cc)
  bool ok = active;
  for (int from = threadIdx.x; from < s.world_size; from += blockDim.x) {
    rows_from[from] = 0;
    if (!active || peer_ptr(c, sym.abort_word, from) != nullptr) continue;
    uint64_t seen = 0;
    const uint64_t want = count_word(epoch, 0, sym.combine_cap);
    const Wait r = wait_ge(c, &sym.combine_count[from], want, &seen);
    if (!check_wait(c, r, kPhaseCombineRecv, from, -1, want, seen, kWhatRowCount)) {
      ok = false;
    } else if (seen - want > static_cast<uint64_t>(sym.combine_cap)) {
      fail(c, kCorruptData, kPhaseCombineRecv, from, -1,
           count_word(epoch, sym.combine_cap, sym.combine_cap), seen, kWhatRowCount);
      ok = false;
    } else {
      rows_from[from] = static_cast<uint32_t>(seen - want);
    }
  }
  ok = __syncthreads_and(ok);
  if (!ok) return false;
  for (int from = 0; from < s.world_size; ++from) {
    for (uint32_t n = threadIdx.x; n < rows_from[from]; n += blockDim.x) {
      const int32_t* header = reinterpret_cast<const int32_t*>(sym.in_entry(from, n));
      const int t = header[0], j = header[1];
      const bool fits = t >= 0 && t < s.max_num_tokens && j >= 0 && j < k;
      const int e = fits ? p.indices[static_cast<size_t>(t) * k + j] : -1;
      if (!fits || e < 0 || e >= s.num_experts || e / L != from) {
        fail(c, kCorruptData, kPhaseCombineRecv, from, t, s.max_num_tokens, j, kWhatRow);
        ok = false;
        continue;
      }
      slot_map[t * k + j] = map_base + n;
    }
  }
  return __syncthreads_and(ok);  // the map is whole before any warp of this block reads it
}

template <typename T, unsigned kPath>  // kernels.h: kDirectOnly or kStagedOnly
__device__ __forceinline__ void combine_recv_body(const CombineRecvParams& p) {
  const CommonParams& c = p.c;
  const Shape& s = c.shape;
  const SymmetricLayout& sym = c.sym;
  auto staged = [&] { return may_stage(kPath) && sym.staged(); };
  const Warps w;
  stamp_start(c, kCombineRecvKernel);
  const int k = s.experts_per_token;
  const int chunks = s.hidden / kElemsPerChunk;
  const int num_tokens = max(0, min(*p.num_tokens, s.max_num_tokens));
  const size_t slot_bytes = static_cast<size_t>(s.hidden) * sizeof(T);

  // P parts per token so that one token keeps the whole grid busy.
  const int max_parts = (chunks + kWarpSize - 1) / kWarpSize;
  const int parts = max(1, min(max_parts, w.total / max(num_tokens, 1)));
  const int part_chunks = (chunks + parts - 1) / parts;
  uint64_t epoch = 0;
  const bool refused = refused_at_start(c, kCombineRecvKernel, kPhaseCombineRecv, &epoch);
  bool healthy = !refused;
  const int L = s.num_local_experts();
  // Staged senders put all their rows for us in one put (combine_send step 4): this block
  // waits for their counts and maps each slot (t, j) to its entry in combine_in.
  uint64_t* slot_map = staged() ? c.scratch.slot_map +
                                          static_cast<size_t>(blockIdx.x) * s.max_num_tokens * k
                                    : nullptr;
  const uint64_t map_base = epoch * (static_cast<uint64_t>(sym.combine_cap) + 1);
  if (staged()) healthy = map_staged_rows(p, healthy, epoch, slot_map, map_base);

  for (int i = w.warp; i < s.max_num_tokens * parts; i += w.total) {
    const int t = i / parts, part = i % parts;
    const int c0 = part * part_chunks, c1 = min(chunks, c0 + part_chunks);
    int4* y_row = reinterpret_cast<int4*>(p.y + static_cast<size_t>(t) * s.hidden);
    uint8_t* slots = p.slot_rows ? p.slot_rows + static_cast<size_t>(t) * k * slot_bytes
                                 : nullptr;
    const int32_t* ids = p.indices + static_cast<size_t>(t) * k;
    const float* wt = p.weights + static_cast<size_t>(t) * k;
    auto valid = [&](int j) { return ids[j] >= 0 && ids[j] < s.num_experts; };
    // Where slot j's row is: in combine_in when its sender is staged, else in combine_rows.
    auto row_of = [&](int j) -> const uint8_t* {
      if (staged() && peer_ptr(c, sym.abort_word, ids[j] / L) == nullptr)
        return sym.in_entry(ids[j] / L, static_cast<uint32_t>(slot_map[t * k + j] - map_base)) +
               kEntryHeaderBytes;
      return sym.combine_row(t, j);
    };

    // Step 1: the rows of every valid slot have landed (lanes poll slots in parallel).
    bool live = healthy && t < num_tokens;
    if (live) {
      bool ok = true;
      for (int j = w.lane; j < k; j += kWarpSize) {
        if (!valid(j)) continue;
        if (staged() && peer_ptr(c, sym.abort_word, ids[j] / L) == nullptr) {
          // Counted in and mapped above; a slot its sender sent no row for keeps an older tag.
          const uint64_t at = slot_map[t * k + j];
          if (at < map_base || at - map_base >= static_cast<uint64_t>(sym.combine_cap)) {
            fail(c, kCorruptData, kPhaseCombineRecv, ids[j] / L, t, map_base, at, kWhatRow);
            ok = false;
          }
          continue;
        }
        uint64_t seen = 0;
        const Wait r = wait_ge<may_stage(kPath)>(c, sym.slot_flag(t, j), epoch, &seen);
        ok &= check_wait(c, r, kPhaseCombineRecv, ids[j] / L, t, epoch, seen, kWhatRow);
      }
      live = __all_sync(0xffffffffu, ok);
      __syncwarp();
      healthy = live;
      if (i == w.warp) stamp_mark(c, kCombineRecvKernel, kWaited);  // block 0: token 0's rows
    }

    // Step 2: weighted sum in f32 over the part's chunks (NaN for failed live tokens, zeros
    // past num_tokens).
    const bool failed = !live && t < num_tokens;
    // The chunks of kSlotBatch slots are loaded before any is summed or stored, so a lane has
    // them in flight together (one at a time, R1's k = 8 rows were 8 round trips per chunk).
    for (int ch = c0 + w.lane; ch < c1; ch += kWarpSize) {
      float acc[kElemsPerChunk] = {};
      for (int j0 = 0; j0 < k; j0 += kSlotBatch<T>) {
        Chunk<T> v[kSlotBatch<T>];
#pragma unroll
        for (int u = 0; u < kSlotBatch<T>; ++u) {
          const int j = j0 + u;
          if (j < k && live && valid(j)) v[u].load(row_of(j), ch);
          else v[u].zero();
        }
#pragma unroll
        for (int u = 0; u < kSlotBatch<T>; ++u) {
          const int j = j0 + u;
          if (j >= k) break;
          if (live && valid(j)) v[u].accumulate(wt[j], acc);
          if (slots) v[u].store(slots + j * slot_bytes, ch);
        }
      }
      y_row[ch] = failed ? nan_bf16x8() : to_bf16x8(acc);
    }
  }

  // Step 3: every rank may overwrite our combine_rows again. The abort word is read before the
  // block barrier, overlapping the other warps' sums.
  const bool acknowledge = !refused && !poisoned(c);
  if (!is_last_block(c, kCombineRecvKernel)) return;
  if (acknowledge) {
    for (int h = threadIdx.x; h < s.world_size; h += blockDim.x)
      set_ack<may_stage(kPath)>(c, &sym.combine_ack[c.rank], epoch, h, kCombineRecvKernel);
  }
  finish_launch(c, kCombineRecvKernel, epoch);
}

}  // namespace
}  // namespace jmc
