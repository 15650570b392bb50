// The one place that knows where everything lives in a handle's symmetric buffer.
//
// One nvshmem_malloc per handle, carved into (every offset 128-byte aligned). Flags come first
// and are zeroed once at creation; no flag is ever reset, every one carries the cycle's epoch
// (1, 2, ...), so a late write of cycle i can never satisfy a wait of cycle i + 1.
//
//   abort_word      [1]            u64  a failing rank SETs abort_value(code, rank) here, everywhere
//   started         [4]            u64  the cycle of this rank's latest start of each kernel
//                                       (KernelId order); read by a peer whose wait timed out
//   heartbeat       [1]            u64  a thread of this process SETs a new value every
//                                       kHeartbeatPeriodNs while it lives (heartbeat.cc)
//   dispatch_count  [G]            u64  sender of group g SETs count_word(epoch, records)
//   dispatch_ack    [world]        u64  receiver r SETs epoch once it has read our records
//   combine_flag    [max_m][k]     u64  slot (t, j) SET to epoch after its expert row
//   combine_ack     [world]        u64  home rank h SETs epoch once it has read our rows
//   combine_count   [world]        u64  staged sender s SETs count_word(epoch, rows, cap) after
//                                       putting its rows for us into combine_in[s]
//   barrier_flag    [world]        u64  benchmark barrier: rank p SETs its barrier epoch
//   recv_records    [G][max_m]     record  tokens from the sender of group g, in slot order
//   combine_rows    [max_m][k]     row (combine dtype)  the expert output of slot (t, j)
//   send_records    [G][max_m]     record  staged records per destination in slot order, sent
//                                          with one put each (only when a peer is not P2P)
//   combine_out     [world][cap]   entry  rows for each staged home rank, packed in arrival
//                                         order, sent with one put each (staged only)
//   combine_in      [world][cap]   entry  rows from each staged sender (staged only)
//
// cap = max_m * min(k, L): the most rows one rank returns to one home. An entry: a 16-byte
// header (int32 token, int32 slot) and the row (combine dtype).
//
// A token record: header (int32 token index, int32 expert ids [k], f32 weights [k]) padded to
// 16 bytes, then H elements of the dispatch dtype, then the f32 block scales padded to 16 bytes.
#pragma once

#include <cuda_runtime.h>  // __host__ __device__

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace jmc {

// fp8 payloads carry one f32 scale per this many elements (quant.py's SCALE_BLOCK); dispatch_recv
// dequantizes in these blocks (core/fp8.cuh; its handler checks H == num_scales * this).
constexpr int kScaleBlock = 128;

struct Shape {
  int num_experts;
  int experts_per_token;  // k
  int hidden;
  int max_num_tokens;     // max_m, per rank
  int world_size;
  int dp_size;            // ranks per group that hold the same tokens
  int in_elem_bytes;      // 1 (fp8) or 2 (bf16)
  int num_scales;         // f32 scales per token, 0 for bf16
  int out_elem_bytes;     // 2 (bf16) or 4 (f32) for expert_y
  // The layout of expert_x/expert_y. packed_rows 0: padded [L, P, H], expert e's rows at e * P,
  // P = expert_rows, the per-expert capacity (0: R, the worst case). packed_rows > 0: packed
  // [packed_rows, H], expert 0's rows, then 1's, ... (a prefix of the counts); its value is
  // the capacity C (<= max_recv_rows()). Rows that arrive past a capacity are never written:
  // with drop_overflow they are dropped (combine sends zero rows for them), else the cycle
  // fails with kCapacityExceeded.
  int packed_rows = 0;
  int drop_overflow = 0;
  int expert_rows = 0;

  __host__ __device__ bool packed() const { return packed_rows > 0; }
  // Rows per local expert of the padded layout (its stride).
  __host__ __device__ int padded_stride() const {
    return expert_rows > 0 ? expert_rows : max_recv_tokens();
  }
  __host__ __device__ int num_local_experts() const { return num_experts / world_size; }
  __host__ __device__ int num_dp_groups() const { return world_size / dp_size; }
  __host__ __device__ int max_recv_tokens() const { return max_num_tokens * num_dp_groups(); }
  // Rows one rank can hold in all: a token sends at most min(k, L) rows to one rank.
  __host__ __device__ int max_recv_rows() const {
    return num_dp_groups() * combine_cap();
  }
  // Rows one rank returns to one home rank at most: each token has <= min(k, L) slots there.
  __host__ __device__ int combine_cap() const {
    const int k = experts_per_token, L = num_local_experts();
    return max_num_tokens * (k < L ? k : L);
  }
  // Rows of expert_x / expert_y (and expert_weights): C packed, L * P padded.
  __host__ __device__ int64_t output_rows() const {
    return packed() ? packed_rows : int64_t{num_local_experts()} * padded_stride();
  }
  // Whether a capacity below the worst case is set: rows can then be dropped.
  __host__ __device__ bool can_drop() const {
    return packed() ? packed_rows < max_recv_rows() : padded_stride() < max_recv_tokens();
  }
  // Entries of row_source: one per output row, then the sources of the rows dropped this
  // cycle, so that combine_send can answer their slots with zero rows: packed, the dropped
  // rows sit at their own positions [C, C + dropped) of a worst-case-long row_source; padded
  // with a per-expert capacity, after the L * P rows, expert by expert (a tail as long as the
  // worst case, max_recv_rows()).
  __host__ __device__ int64_t row_source_entries() const {
    if (packed()) return max_recv_rows();
    return output_rows() + (can_drop() ? max_recv_rows() : 0);
  }

};

__host__ __device__ constexpr size_t round_up(size_t x, size_t to) {
  return (x + to - 1) / to * to;
}

struct RecordLayout {
  uint32_t header_bytes;   // token index + k expert ids + k weights
  uint32_t payload_bytes;  // H * in_elem_bytes
  uint32_t scale_bytes;    // num_scales * 4, padded
  uint32_t bytes;          // whole record, a multiple of 16

  static RecordLayout of(const Shape& s) {
    RecordLayout r;
    r.header_bytes = static_cast<uint32_t>(round_up(4 * (1 + 2 * s.experts_per_token), 16));
    r.payload_bytes = static_cast<uint32_t>(s.hidden) * s.in_elem_bytes;
    r.scale_bytes = static_cast<uint32_t>(round_up(4 * s.num_scales, 16));
    r.bytes = r.header_bytes + r.payload_bytes + r.scale_bytes;
    return r;
  }
};

// Pointers into one rank's symmetric buffer. The same offsets hold on every rank, so a
// local pointer from here is also the remote address to hand to nvshmem (or nvshmem_ptr).
// A staged combine entry's header: int32 token, int32 slot, padded so the row is 16-aligned.
constexpr uint32_t kEntryHeaderBytes = 16;

// Kernels (KernelId, kernels/kernels.h) whose latest start each rank marks in `started`.
constexpr int kStartedKernels = 4;

// The heartbeat word's period, and how long a peer must see it unchanged to take the process
// for gone (protocol.cuh, wait_for_late_start): ten beats, so that a host whose scheduler is
// busy (eight processes compiling on one machine) delays a beat, not ten.
constexpr uint64_t kHeartbeatPeriodNs = 100'000'000;
constexpr uint64_t kHeartbeatStaleNs = 10 * kHeartbeatPeriodNs;

struct SymmetricLayout {
  uint64_t* abort_word;
  uint64_t* started;  // [kStartedKernels]
  uint64_t* heartbeat;
  uint64_t* dispatch_count;
  uint64_t* dispatch_ack;
  uint64_t* combine_flag;
  uint64_t* combine_ack;
  uint64_t* combine_count;  // [world]
  uint64_t* barrier_flag;
  uint8_t* recv_records;
  uint8_t* combine_rows;
  uint8_t* send_records;     // nullptr unless staged
  uint8_t* combine_out;  // nullptr unless staged
  uint8_t* combine_in;   // nullptr unless staged
  RecordLayout record;
  uint32_t combine_row_bytes;    // H * out_elem_bytes
  uint32_t combine_entry_bytes;  // kEntryHeaderBytes + combine_row_bytes
  int combine_cap;               // Shape::combine_cap()
  int num_groups;              // G
  int max_m;
  int k;

  // Lays the buffer out over `base` (nullptr: only computes the size). `staged`: some peer is
  // not reachable by load/store, so puts to it need symmetric sources.
  static SymmetricLayout carve(const Shape& s, bool staged, void* base, size_t* total_bytes) {
    SymmetricLayout l;
    l.record = RecordLayout::of(s);
    l.combine_row_bytes = static_cast<uint32_t>(s.hidden) * s.out_elem_bytes;
    l.combine_entry_bytes = kEntryHeaderBytes + l.combine_row_bytes;
    l.combine_cap = s.combine_cap();
    l.num_groups = s.num_dp_groups();
    l.max_m = s.max_num_tokens;
    l.k = s.experts_per_token;
    uint8_t* p = static_cast<uint8_t*>(base);
    size_t off = 0;
    auto take = [&](size_t bytes) {
      uint8_t* at = p ? p + off : nullptr;
      off = round_up(off + bytes, 128);
      return at;
    };
    auto take_u64 = [&](size_t n) { return reinterpret_cast<uint64_t*>(take(8 * n)); };
    const size_t G = l.num_groups, m = l.max_m, k = l.k, W = s.world_size;
    l.abort_word = take_u64(1);
    l.started = take_u64(kStartedKernels);
    l.heartbeat = take_u64(1);
    l.dispatch_count = take_u64(G);
    l.dispatch_ack = take_u64(W);
    l.combine_flag = take_u64(m * k);
    l.combine_ack = take_u64(W);
    l.combine_count = take_u64(W);
    l.barrier_flag = take_u64(W);
    l.flag_bytes_ = off;
    l.recv_records = take(G * m * l.record.bytes);
    l.combine_rows = take(m * k * l.combine_row_bytes);
    l.send_records = staged ? take(m * G * l.record.bytes) : nullptr;
    const size_t entries = W * static_cast<size_t>(l.combine_cap);
    l.combine_out = staged ? take(entries * l.combine_entry_bytes) : nullptr;
    l.combine_in = staged ? take(entries * l.combine_entry_bytes) : nullptr;
    *total_bytes = off;
    return l;
  }
  // Some peer is reached through a network transport, not by load/store (so puts are staged
  // and waits need NVSHMEM's consistency hook). The same on every rank.
  __host__ __device__ bool staged() const { return send_records != nullptr; }
  // Bytes at the front that hold flags and counters (zeroed once at creation).
  size_t flag_bytes() const { return flag_bytes_; }

  __host__ __device__ uint8_t* recv_record(int group, int slot) const {
    return recv_records + (static_cast<size_t>(group) * max_m + slot) * record.bytes;
  }
  __host__ __device__ uint8_t* send_record(int group_index, int slot) const {
    return send_records + (static_cast<size_t>(group_index) * max_m + slot) * record.bytes;
  }
  __host__ __device__ uint8_t* combine_row(int t, int j) const {
    return combine_rows + (static_cast<size_t>(t) * k + j) * combine_row_bytes;
  }
  __host__ __device__ uint64_t* slot_flag(int t, int j) const {
    return combine_flag + static_cast<size_t>(t) * k + j;
  }
  // Entry n of the rows for staged home h (combine_out) or from staged sender s (combine_in).
  __host__ __device__ uint8_t* out_entry(int h, int n) const {
    return combine_out + (static_cast<size_t>(h) * combine_cap + n) * combine_entry_bytes;
  }
  __host__ __device__ uint8_t* in_entry(int sender, int n) const {
    return combine_in + (static_cast<size_t>(sender) * combine_cap + n) * combine_entry_bytes;
  }

  size_t flag_bytes_ = 0;
};

// Where each peer's copy of a handle's symmetric buffer appears in this process: nvshmem_ptr of
// the buffer's base, read once at creation (nullptr: not reachable by load/store). A kernel
// turns a local symmetric pointer into a peer's with one add from its parameters (constant
// bank), where the device-side nvshmem_ptr is a global load per call, missed in L1 after every
// acquire (which invalidates it): a dependent ~0.3-0.5 us before each store to a peer.
// Peers from kMaxPeerTable on use nvshmem_ptr (only a node's peers are reachable anyway).
constexpr int kMaxPeerTable = 64;
struct PeerTable {
  uint8_t* base[kMaxPeerTable];
};

// Where an expert row came from, packed into one int32 of row_source: (group, token, slot).
__host__ __device__ inline int32_t pack_source(int group, int token, int slot, int max_m,
                                               int k) {
  return (group * max_m + token) * k + slot;
}

// A dispatch count word: the epoch it belongs to and the number of records (<= max_m), as
// epoch * (max_m + 1) + count, so it grows with the epoch and a wait for ">= this cycle's
// word with 0 records" works. The 32-bit epoch field it replaces wrapped after 2^32 cycles (one
// handle serves every layer: 58 layers x 50 steps/s is 17 days); this one wraps after
// 2^64 / (max_m + 1) cycles: 1.4e17 at max_m = 128, 10 years at 10^6 cycles/s up to
// max_m = 58,000.
__host__ __device__ inline uint64_t count_word(uint64_t epoch, uint32_t count, int max_m) {
  return epoch * (static_cast<uint64_t>(max_m) + 1) + count;
}

}  // namespace jmc
