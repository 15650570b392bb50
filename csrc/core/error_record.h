// Where kernels leave the first error they meet: pinned, device-mapped host memory, so the host
// reads it without a device sync. The first error wins; later ones are dropped.
#pragma once

#include <cstdint>

namespace jmc {

enum ErrorCode : uint32_t {
  kOk = 0,
  kPeerTimeout = 1,     // a bounded wait for a peer ran out
  kBadExpertIndex = 2,  // an expert index outside [-1, num_experts)
  kBadNumTokens = 3,    // num_tokens outside [0, max_num_tokens]
};

enum Phase : uint32_t {
  kPhaseNone = 0,
  kPhaseDispatchSend = 1,
  kPhaseDispatchRecv = 2,
  kPhaseCombineSend = 3,
  kPhaseCombineRecv = 4,
  kPhaseBarrier = 5,
};

struct ErrorRecord {
  uint32_t code;
  uint32_t phase;
  int32_t peer;      // rank waited for, or -1
  int32_t token;     // token index involved, or -1
  uint64_t expected; // value waited for / bad value seen
  uint64_t seen;     // last value read
};

#ifdef __CUDACC__
__device__ __forceinline__ void record_error(ErrorRecord* rec, ErrorCode code, Phase phase,
                                             int peer, int token, uint64_t expected,
                                             uint64_t seen) {
  if (atomicCAS(&rec->code, 0u, static_cast<uint32_t>(code)) == 0u) {
    rec->phase = phase;
    rec->peer = peer;
    rec->token = token;
    rec->expected = expected;
    rec->seen = seen;
    __threadfence_system();
  }
}
#endif

}  // namespace jmc
