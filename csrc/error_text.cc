// The words of an error record (error_text.h): what failed, where, and where a late peer stood.
#include "error_text.h"

#include <cuda_runtime.h>

#include <string>

#include "handle.h"

namespace jmc {
namespace {

const char* phase_name(uint32_t phase) {
  static const char* kPhases[] = {"?", "dispatch_send", "dispatch_recv", "combine_send",
                                  "combine_recv", "barrier"};
  return phase < 6 ? kPhases[phase] : "?";
}

const char* what_name(uint32_t what) {
  static const char* kWhat[] = {"",
                                "its acknowledgement of the previous cycle",
                                "its record count",
                                "a token record",
                                "an expert row",
                                "the cycle number",
                                "expert_num_tokens",
                                "its row count",
                                "a local expert's rows"};
  return what < 9 ? kWhat[what] : "?";
}

const char* code_name(uint32_t code) {
  static const char* kCodes[] = {"Ok",          "PeerTimeout",   "InvalidRouting",
                                 "InvalidRouting", "CorruptData", "PeerAborted",
                                 "ProtocolError",  "ProtocolError", "CapacityExceeded"};
  return code < 9 ? kCodes[code] : "Unknown";
}

// What a kOutOfOrder launch broke, by the phase it was refused in.
std::string out_of_order_reason(uint32_t phase) {
  switch (phase) {
    case kPhaseDispatchSend:
      return "a dispatch is already in flight (call dispatch_recv before the next "
             "dispatch_send or dispatch)";
    case kPhaseDispatchRecv: return "no dispatch_send before it";
    case kPhaseCombineSend:
      return "a combine is already in flight (call combine_recv before the next "
             "combine_send or combine)";
    case kPhaseCombineRecv: return "no combine_send before it";
    default: return "a dispatch or combine is in flight";
  }
}

// Where the rank a wait timed out on stood (ErrorRecord's peer view), as a sentence; "" if the
// record has none. Cycles count from 1 per half; a rank's latest start is its started mark
// with the highest (cycle, kernel order).
std::string peer_state(const ErrorRecord& rec) {
  if (rec.view.needed_kernel == 0 || rec.view.needed_kernel > kNumKernels) return "";
  const int needed = static_cast<int>(rec.view.needed_kernel) - 1;
  const uint64_t cycle = rec.view.needed_cycle;
  const std::string peer = "rank " + std::to_string(rec.peer);
  const std::string kernel = phase_name(needed + 1);  // phases number the kernels from 1
  int latest = 0;
  for (int k = 1; k < kNumKernels; ++k)
    if (rec.view.started[k] >= rec.view.started[latest]) latest = k;
  const std::string latest_start =
      rec.view.started[latest] == 0
          ? "it started no kernel on this handle since its creation or recover()"
          : std::string("its latest start: ") + phase_name(latest + 1) + " of cycle " +
                std::to_string(rec.view.started[latest]);
  if (rec.view.started[needed] >= cycle)
    return ". " + peer + " had started its " + kernel + " of cycle " + std::to_string(cycle) +
           " and not delivered: it stalled inside it (waiting on another rank, or its GPU or "
           "process hangs)";
  if (rec.view.started[latest] >= cycle)
    return ". " + peer + " is mid-cycle: it has not started its " + kernel + " of cycle " +
           std::to_string(cycle) + " (" + latest_start +
           "): it is held up between ops (host work or a host pause between them)";
  const std::string not_started =
      ". " + peer + " has not started cycle " + std::to_string(cycle) + " (" + latest_start + ")";
  if (rec.view.late == kLateSilent)
    return not_started + " and its process stopped its heartbeat on this handle: it is gone "
                         "(killed, crashed), closed the handle, or its host hangs";
  if (rec.view.late == kLateAlive)
    return not_started + " within start_timeout_s, though its process was alive: it is later "
                         "than that (a host pause, a checkpoint save, a compile)";
  return not_started + ": it is late (a host pause, a checkpoint save, a compile longer than "
                       "timeout_s) or gone";
}

}  // namespace

std::string describe_error(const ErrorRecord& rec, int rank) {
  const std::string where = std::string("rank ") + std::to_string(rank) + " in " +
                            phase_name(rec.phase) + ": ";
  const std::string peer = "rank " + std::to_string(rec.peer);
  switch (rec.code) {
    case kOk:
      return "";
    case kPeerTimeout:
      return "PeerTimeout: " + where + "waited for " +
             (rec.peer >= 0 ? peer + " (" + what_name(rec.what) + ")"
                            : "the expert rows of token " + std::to_string(rec.token)) +
             ", expected >= " + std::to_string(rec.expected) + ", saw " +
             std::to_string(rec.seen) + " when the timeout passed" + peer_state(rec);
    case kBadExpertIndex:
      return "InvalidRouting: " + where + "token " + std::to_string(rec.token) +
             " has expert index " + std::to_string(static_cast<int64_t>(rec.seen)) +
             " outside [-1, " + std::to_string(rec.expected) + ")";
    case kBadNumTokens:
      return "InvalidRouting: " + where + "num_tokens=" +
             std::to_string(static_cast<int64_t>(rec.seen)) + " outside [0, " +
             std::to_string(rec.expected) + "]";
    case kCorruptData:
      return "CorruptData: " + where + what_name(rec.what) +
             (rec.peer >= 0 ? " from " + peer : std::string()) + " is out of range: " +
             std::to_string(static_cast<int64_t>(rec.seen)) + " (bound " +
             std::to_string(rec.expected) + "); it was dropped";
    case kPeerAborted:
      return "PeerAborted: " + where + peer + " reported " + code_name(rec.expected) +
             " first, so this rank stopped waiting (see rank " + std::to_string(rec.peer) +
             "'s error)";
    case kStaleLaunch:
      return "ProtocolError: " + where + "a launch on handle after close() (a compiled step "
             "replayed a recorded launch); it did nothing, and the step's outputs on this rank "
             "are not data (y is NaN)";
    case kCapacityExceeded:
      if (rec.what == kWhatExpertRows)  // padded: seen = rows past the per-expert capacity
        return "CapacityExceeded: " + where + std::to_string(rec.seen) +
               " expert rows arrived past expert_capacity=" + std::to_string(rec.expected) +
               " (per local expert) this cycle; they were not written and the handle stopped "
               "(overflow='fail'; recover() restarts it). Raise expert_capacity "
               "(MoEConfig.rows_per_expert_for with a larger capacity factor), or create the "
               "handle with overflow='drop' to drop such rows and go on";
      return "CapacityExceeded: " + where + std::to_string(rec.seen) +
             " expert rows arrived this cycle, more than max_recv_rows=" +
             std::to_string(rec.expected) + "; the " + std::to_string(rec.seen - rec.expected) +
             " rows past it were not written and the handle stopped (overflow='fail'; "
             "recover() restarts it). Raise max_recv_rows (MoEConfig.recv_rows_for with a larger "
             "capacity factor), or create the handle with overflow='drop' to drop such rows "
             "and go on";
    case kOutOfOrder:
      return "ProtocolError: " + where + out_of_order_reason(rec.phase) + " (sends completed " +
             std::to_string(rec.expected) + ", receives completed " + std::to_string(rec.seen) +
             "); the launch did nothing";
    default:
      return "Unknown: " + where + "error code " + std::to_string(rec.code);
  }
}

std::string describe_abort(const Handle& h) {
  if (h.symmetric == nullptr) return "";
  uint64_t word = 0;
  if (cudaMemcpy(&word, h.sym.abort_word, sizeof(word), cudaMemcpyDeviceToHost) != cudaSuccess)
    return "";
  if (word == 0) return "";
  return "PeerAborted: rank " + std::to_string(h.rank) + ": rank " +
         std::to_string(abort_rank(word)) + " reported " + code_name(abort_code(word)) +
         " on this handle (see rank " + std::to_string(abort_rank(word)) + "'s error)";
}

}  // namespace jmc
