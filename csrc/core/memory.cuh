// Memory-ordering helpers: operation, ordering and scope in every name. Inline PTX lives here.
#pragma once

#include <cstdint>

namespace jmc {

// cuda::atomic_ref<uint64_t, thread_scope_system>(*p).load(memory_order_acquire)
__device__ __forceinline__ uint64_t ld_acquire_sys_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// cuda::atomic_ref<uint64_t, thread_scope_system>(*p).store(v, memory_order_relaxed)
__device__ __forceinline__ void st_relaxed_sys_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Nanoseconds of the GPU's global timer (coarse, but shared by all SMs).
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spin until *p >= expected or the deadline passes. Returns whether it was met; the last
// value read goes to *seen either way. Never traps: the caller records the timeout.
__device__ __forceinline__ bool wait_ge_acquire_sys_u64(const uint64_t* p, uint64_t expected,
                                                        uint64_t deadline_ns, uint64_t* seen) {
  uint64_t v = ld_acquire_sys_u64(p);
  while (v < expected) {
    if (globaltimer_ns() > deadline_ns) {
      *seen = v;
      return false;
    }
    __nanosleep(64);
    v = ld_acquire_sys_u64(p);
  }
  *seen = v;
  return true;
}

// Warp-uniform version: lane 0 polls, every lane gets the same verdict and value, so the warp
// never diverges on a race between "arrived" and "deadline". The fence after the broadcast
// orders the other lanes' later reads after lane 0's acquire.
__device__ __forceinline__ bool warp_wait_ge_acquire_sys_u64(const uint64_t* p,
                                                             uint64_t expected,
                                                             uint64_t deadline_ns,
                                                             uint64_t* seen, int lane) {
  uint64_t v = 0;
  int ok = 0;
  if (lane == 0) ok = wait_ge_acquire_sys_u64(p, expected, deadline_ns, &v);
  ok = __shfl_sync(0xffffffffu, ok, 0);
  v = __shfl_sync(0xffffffffu, v, 0);
  __threadfence();
  *seen = v;
  return ok != 0;
}

}  // namespace jmc
