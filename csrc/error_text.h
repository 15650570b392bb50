// Error records as the messages users read (errors.py maps their first word to an exception).
#pragma once

#include <string>

#include "core/error_record.h"

namespace jmc {

struct Handle;

// "" if the handle's kernels recorded no error, else a message naming the error kind first.
std::string describe_error(const ErrorRecord& rec, int rank);
// The abort word of the handle (device read: synchronizes), described; "" when clear.
std::string describe_abort(const Handle& h);

}  // namespace jmc
