// The host heartbeat: while this process lives, a thread of it SETs a new value into every open
// handle's heartbeat word (core/layout.h) every kHeartbeatPeriodNs. A peer whose wait for our
// dispatch count timed out before we started the cycle reads it (protocol.cuh,
// wait_for_late_start): a beating process is late (a compile, a checkpoint) and is waited for
// up to start_timeout_s; a silent one is gone, reported within kHeartbeatStaleNs.
#pragma once

#include <cstdint>
#include <string>

namespace jmc {

// Beats into `word` (a handle's heartbeat word, device memory of CUDA device `device`) from
// now on; starts the thread on first use. "" or what failed.
std::string heartbeat_watch(uint64_t* word, int device);
// Stops beating into `word`. When it returns no copy into it is in flight: call it before the
// memory is freed.
void heartbeat_forget(uint64_t* word);
// Ends the thread (finalize(), and at process exit); a later heartbeat_watch starts it again.
void heartbeat_stop();

}  // namespace jmc
