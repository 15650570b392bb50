// The launch plan of a handle (launch_plan.h): grids, fused ops, dependent launches, acks.
#include "launch_plan.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <initializer_list>

namespace jmc {
namespace {

// SMs this process may use. Under MPS with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE the attribute
// already reports the client's share (14 of 132 SMs at 12 % on the GPU machine's driver 580:
// scaling it again gave 2 SMs and 4-block grids, 2.4x slower at R1 T=128; docs/notes.md).
int usable_sms() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      sms <= 0)
    return 16;
  return sms;
}

// One kernel's grid: at most one full wave of the SM share (its blocks spin on peers, so a
// second wave would only queue), and no more warps than the kernel has work items for.
Launch launch_for(const Shape& s, KernelId kernel, Launch tuning) {
  const int wpb = tuning.warps_per_block;
  if (tuning.num_blocks > 0) return Launch{tuning.num_blocks, wpb};
  // A debugging override (tests force one block to tell grid-size bugs from others).
  if (const char* forced = std::getenv("JMC_NUM_BLOCKS")) {
    const int blocks = std::atoi(forced);
    if (blocks > 0) return Launch{blocks, wpb};
  }
  const int wave = usable_sms() * std::max(1, blocks_per_sm(s, kernel, wpb));
  const int chunks = s.hidden / 8;
  int64_t items = 0;  // the most warps the kernel can keep busy
  switch (kernel) {
    case kDispatchSendKernel:
    case kDispatchRecvKernel: items = int64_t{s.max_num_tokens} * s.num_dp_groups(); break;
    case kCombineSendKernel: items = s.max_recv_rows(); break;
    case kCombineRecvKernel: items = int64_t{s.max_num_tokens} * ((chunks + 31) / 32); break;
  }
  const int64_t needed = (items + wpb - 1) / wpb;
  return Launch{static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wave, needed))), wpb};
}

// A fused op runs as ONE block, or not at all (num_blocks 0: the handler launches the two split
// kernels). Its recv waits on sends of its own grid, so every block must be resident at once,
// and under MPS nothing reserves the SM share: a 28-block fused grid (one wave by the
// occupancy API) deadlocked at V2-Lite T=64 (commit 3a53b3f). One block is always resident.
// It pays while one block has a warp per work item: (token, destination) pairs for dispatch,
// slot rows for combine. Measured at 15fe1ae (8 ranks, fp8): at 1 token fused vs split
// V2-Lite 59.2 vs 69.8 us, R1 89.4 vs 96.3; at 4 tokens a one-block dispatch (32 pairs on 16
// warps) was slower than the split kernels (R1 79.1 vs 65.5 us dispatch).
// JMC_FUSED (tests): "always" runs the fused kernel (one block) at any shape, "never" never;
// unset or empty, the rule above.
enum class FusedMode { kAuto, kAlways, kNever };

// An environment setting read at creation: its value ("" when unset) and its index in the
// accepted values, or -1 (create_handle refuses it, naming the accepted values).
struct EnvChoice {
  std::string value;
  int index;
};

EnvChoice env_choice(const char* name, std::initializer_list<const char*> accepted) {
  const char* set = std::getenv(name);
  EnvChoice choice{set ? set : "", -1};
  int i = 0;
  for (const char* value : accepted) {
    if (choice.value == value) choice.index = i;
    ++i;
  }
  return choice;
}

std::string env_refusal(const char* name, const EnvChoice& choice, const char* expected) {
  return std::string(name) + "=" + choice.value + ": expected " + expected;
}

// The device supports it (compute capability 9.0+) and the kernel image running on it has the
// griddepcontrol.wait (built from compute_90+ code: a build for sm_80 only, JIT-compiled on a
// Hopper, launched as dependents, would read its predecessor's outputs unordered).
bool device_has_dependent_launch() {
  int device = 0, major = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) ==
             cudaSuccess &&
         major >= 9 && kernels_wait_for_previous();
}

Launch fused_launch_for(const Shape& s, FusedOp op, int warps_per_block, FusedMode mode) {
  if (mode == FusedMode::kAlways) return Launch{1, warps_per_block};
  if (mode == FusedMode::kNever) return Launch{0, warps_per_block};
  const int64_t items = int64_t{s.max_num_tokens} *
                        (op == kFusedDispatch ? s.num_dp_groups() : s.experts_per_token);
  return Launch{items <= warps_per_block ? 1 : 0, warps_per_block};
}

}  // namespace

std::string plan_launch(const Shape& shape, Launch tuning, LaunchPlan* plan) {
  // Settings agreed across ranks before creation (PROTOCOL_ENV), read here.
  const EnvChoice fused = env_choice("JMC_FUSED", {"", "always", "never"});  // FusedMode's order
  if (fused.index < 0) return env_refusal("JMC_FUSED", fused, "always, never or unset");
  // JMC_PDL: "0" launches every kernel stream-ordered (for measuring what programmatic dependent
  // launch gains); unset, empty or "1": dependent launches on compute capability 9.0 and newer.
  const EnvChoice pdl = env_choice("JMC_PDL", {"", "1", "0"});
  if (pdl.index < 0) return env_refusal("JMC_PDL", pdl, "0, 1 or unset");
  // JMC_ACKS: "release" acknowledges load/store peers with a release store (for A/B timing and
  // as a fallback); unset, empty or "relaxed": a relaxed store (protocol.cuh, set_ack).
  const EnvChoice acks = env_choice("JMC_ACKS", {"", "relaxed", "release"});
  if (acks.index < 0) return env_refusal("JMC_ACKS", acks, "relaxed, release or unset");
  plan->release_acks = acks.value == "release";
  for (int kernel = 0; kernel < kNumKernels; ++kernel)
    plan->launch[kernel] = launch_for(shape, static_cast<KernelId>(kernel), tuning);
  for (int op = 0; op < kNumFusedOps; ++op)
    plan->fused_launch[op] = fused_launch_for(shape, static_cast<FusedOp>(op),
                                              tuning.warps_per_block,
                                              static_cast<FusedMode>(fused.index));
  plan->dependent_launch = pdl.value != "0" && device_has_dependent_launch();
  for (Launch& l : plan->launch) l.dependent_launch = plan->dependent_launch;
  for (Launch& l : plan->fused_launch) l.dependent_launch = plan->dependent_launch;
  return "";
}

}  // namespace jmc
