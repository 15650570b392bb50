// Memory-ordering helpers: operation, ordering and scope in every name. Inline PTX lives here.
#pragma once

#include <cstdint>

namespace jmc {

// cuda::atomic_ref<uint64_t, thread_scope_system>(*p).load(memory_order_relaxed)
// The polling load: no L1 invalidation (ld.acquire.sys costs a CCTL.IVALL per call, §11).
__device__ __forceinline__ uint64_t ld_relaxed_sys_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// cuda::atomic_ref<uint64_t, thread_scope_system>(*p).load(memory_order_acquire)
// Once, after a relaxed poll saw the value: later reads see what the writer released.
__device__ __forceinline__ uint64_t ld_acquire_sys_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// cuda::atomic_ref<uint64_t, thread_scope_system>(*p).store(v, memory_order_release)
// Publishes every write this thread made or observed before (a warp/block sync first makes the
// other lanes' writes observed), then the flag. SASS: MEMBAR.ALL.SYS + the store, where
// __threadfence_system() + a relaxed store (NVSHMEM's own P2P put-with-signal order) is the
// stronger MEMBAR.SC.SYS plus an L1 invalidation: more than a release needs.
__device__ __forceinline__ void st_release_sys_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// cuda::atomic_ref<uint64_t, thread_scope_system>(*p).store(v, memory_order_relaxed)
// A word peers may read but nothing waits on (a kernel's start mark): no fence.
__device__ __forceinline__ void st_relaxed_sys_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Nanoseconds of the GPU's global timer (coarse, but shared by all SMs).
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace jmc
