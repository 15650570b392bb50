// Host-only probe of csrc/core/layout.h for tests/test_layout_cc.py: carves a handle's
// symmetric buffer (as handle.cc does) for the shape on the command line and prints where each
// area lies, as JSON, plus ll_tag of a few epochs.
//   layout_probe E k H max_m world dp in_bytes num_scales out_bytes staged ll
#include <cstdio>
#include <cstdlib>

#include "core/layout.h"

int main(int argc, char** argv) {
  if (argc != 12) return 2;
  int v[11];
  for (int i = 0; i < 11; ++i) v[i] = std::atoi(argv[i + 1]);
  jmc::Shape s{};
  s.num_experts = v[0];
  s.experts_per_token = v[1];
  s.hidden = v[2];
  s.max_num_tokens = v[3];
  s.world_size = v[4];
  s.dp_size = v[5];
  s.in_elem_bytes = v[6];
  s.num_scales = v[7];
  s.out_elem_bytes = v[8];
  size_t total = 0;
  // A non-null base (with nullptr carve only sizes the buffer); never dereferenced.
  uint8_t* base = reinterpret_cast<uint8_t*>(uintptr_t{1} << 20);
  const jmc::SymmetricLayout l = jmc::SymmetricLayout::carve(s, v[9] != 0, v[10] != 0, base,
                                                             &total);
  auto at = [&](const void* p) {
    return p == nullptr ? -1L : static_cast<long>(static_cast<const uint8_t*>(p) - base);
  };
  std::printf(
      "{\"total\": %zu, \"flag_bytes\": %zu, \"ll\": %d, \"record_bytes\": %u, "
      "\"row_bytes\": %u, \"barrier_flag\": %ld, \"recv_records_ll\": %ld, "
      "\"combine_rows_ll\": %ld, \"recv_records\": %ld, \"combine_rows\": %ld, "
      "\"send_records\": %ld, \"recv_record_ll_1_0\": %ld, \"combine_row_ll_0_1\": %ld, "
      "\"tags\": [%u, %u, %u, %u, %u]}\n",
      total, l.flag_bytes(), l.ll() ? 1 : 0, l.record.bytes, l.combine_row_bytes,
      at(l.barrier_flag), at(l.recv_records_ll), at(l.combine_rows_ll), at(l.recv_records),
      at(l.combine_rows), at(l.send_records), l.ll() ? at(l.recv_record_ll(1, 0)) : -1L,
      l.ll() ? at(l.combine_row_ll(0, 1)) : -1L, jmc::ll_tag(1), jmc::ll_tag(0xFFFFFFFEull),
      jmc::ll_tag(0xFFFFFFFFull), jmc::ll_tag(0x1FFFFFFFEull), jmc::ll_tag(~0ull));
  return 0;
}
