// Error types of the core. The c10d adapter maps them onto the Python exceptions users of
// torch.distributed expect (ValueError for bad arguments, DistBackendError for peer faults).
#pragma once

#include <stdexcept>
#include <string>

namespace resident {

// A caller passed something the backend cannot do (shape, dtype, op, device).
class InvalidArgument : public std::invalid_argument {
 public:
  explicit InvalidArgument(const std::string& what) : std::invalid_argument(what) {}
};

// Peers disagree about an operation (size, dtype, kind), a peer died, or a wait timed out.
// The communicator is unusable afterwards.
class CommError : public std::runtime_error {
 public:
  explicit CommError(const std::string& what) : std::runtime_error(what) {}
};

// A wait on a peer passed its deadline.
class TimeoutError : public CommError {
 public:
  explicit TimeoutError(const std::string& what) : CommError(what) {}
};

}  // namespace resident
