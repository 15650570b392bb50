// The one place that knows where everything lives in a handle's symmetric buffer.
//
// One nvshmem_malloc per handle, carved into (all offsets 128-byte aligned):
//   dispatch_count   [G]            u64  sender of group g SETs count+1 (0 = not yet)
//   dispatch_arrived [G]            u64  +1 per token record put by the sender of group g
//   combine_flag     [world]        u64  peer p SETs 1 when it entered combine_send
//   combine_arrived  [max_m]        u64  +1 per expert row put back for token t
//   barrier_flag     [world]        u64  peer p SETs its barrier epoch
//   send_records     [max_m]        record  this rank's packed tokens (put source)
//   recv_records     [G][max_m]     record  tokens from the sender of group g, compacted
//   combine_rows     [max_m][k]     row of combine dtype  expert output for slot (t, j)
//
// A token record: header (int32 token index, int32 expert ids [k]) padded to 16 bytes,
// then H elements of the dispatch dtype, then the f32 block scales padded to 16 bytes.
#pragma once

#include <cuda_runtime.h>  // __host__ __device__

#include <cstddef>
#include <cstdint>

namespace jmc {

struct Shape {
  int num_experts;
  int experts_per_token;  // k
  int hidden;
  int max_num_tokens;     // max_m
  int world_size;
  int dp_size;
  int in_elem_bytes;      // 1 (fp8) or 2 (bf16)
  int num_scales;         // f32 scales per token, 0 for bf16
  int out_elem_bytes;     // 2 (bf16) or 4 (f32) for expert_y

  __host__ __device__ int num_local_experts() const { return num_experts / world_size; }
  __host__ __device__ int num_dp_groups() const { return world_size / dp_size; }
  __host__ __device__ int max_recv_tokens() const { return max_num_tokens * num_dp_groups(); }
};

__host__ __device__ constexpr size_t round_up(size_t x, size_t to) {
  return (x + to - 1) / to * to;
}

struct RecordLayout {
  uint32_t header_bytes;   // token index + k expert ids
  uint32_t payload_bytes;  // H * in_elem_bytes
  uint32_t scale_bytes;    // num_scales * 4, padded
  uint32_t bytes;          // whole record, a multiple of 16

  static RecordLayout of(const Shape& s) {
    RecordLayout r;
    r.header_bytes = static_cast<uint32_t>(round_up(4 * (1 + s.experts_per_token), 16));
    r.payload_bytes = static_cast<uint32_t>(s.hidden) * s.in_elem_bytes;
    r.scale_bytes = static_cast<uint32_t>(round_up(4 * s.num_scales, 16));
    r.bytes = r.header_bytes + r.payload_bytes + r.scale_bytes;
    return r;
  }
};

// Pointers into one rank's symmetric buffer. The same offsets hold on every rank, so a
// local pointer from here is also the remote address to hand to nvshmem puts.
struct SymmetricLayout {
  uint64_t* dispatch_count;
  uint64_t* dispatch_arrived;
  uint64_t* combine_flag;
  uint64_t* combine_arrived;
  uint64_t* barrier_flag;
  uint8_t* send_records;
  uint8_t* recv_records;
  uint8_t* combine_rows;
  RecordLayout record;
  uint32_t combine_row_bytes;  // H * out_elem_bytes

  // Lays the buffer out over `base` (nullptr: only computes the size).
  static SymmetricLayout carve(const Shape& s, void* base, size_t* total_bytes) {
    SymmetricLayout l;
    l.record = RecordLayout::of(s);
    l.combine_row_bytes = static_cast<uint32_t>(s.hidden) * s.out_elem_bytes;
    uint8_t* p = static_cast<uint8_t*>(base);
    size_t off = 0;
    auto take = [&](size_t bytes) {
      uint8_t* at = p ? p + off : nullptr;
      off = round_up(off + bytes, 128);
      return at;
    };
    const size_t G = s.num_dp_groups(), m = s.max_num_tokens, k = s.experts_per_token;
    l.dispatch_count = reinterpret_cast<uint64_t*>(take(8 * G));
    l.dispatch_arrived = reinterpret_cast<uint64_t*>(take(8 * G));
    l.combine_flag = reinterpret_cast<uint64_t*>(take(8 * s.world_size));
    l.combine_arrived = reinterpret_cast<uint64_t*>(take(8 * m));
    l.barrier_flag = reinterpret_cast<uint64_t*>(take(8 * s.world_size));
    l.send_records = take(m * l.record.bytes);
    l.recv_records = take(G * m * l.record.bytes);
    l.combine_rows = take(m * k * l.combine_row_bytes);
    *total_bytes = off;
    return l;
  }
  // Bytes at the front that hold flags and counters (zeroed once at creation).
  size_t flag_bytes() const {
    return static_cast<size_t>(send_records - reinterpret_cast<uint8_t*>(dispatch_count));
  }

  __host__ __device__ uint8_t* send_record(int t) const {
    return send_records + static_cast<size_t>(t) * record.bytes;
  }
  __host__ __device__ uint8_t* recv_record(int group, int slot, int max_m) const {
    return recv_records + (static_cast<size_t>(group) * max_m + slot) * record.bytes;
  }
  __host__ __device__ uint8_t* combine_row(int t, int j, int k) const {
    return combine_rows + (static_cast<size_t>(t) * k + j) * combine_row_bytes;
  }
};

// Where an expert row came from, packed into one int32 of row_source: (group, token, slot).
__host__ __device__ inline int32_t pack_source(int group, int token, int slot, int max_m,
                                               int k) {
  return (group * max_m + token) * k + slot;
}

}  // namespace jmc
