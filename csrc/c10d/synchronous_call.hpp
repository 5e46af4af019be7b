// torch's synchronous collectives (dist.all_reduce(t) and the others without async_op) turn the
// options' asyncOp off and call wait() on the returned Work only when there is one ("the backend
// has sync'ed at CPP level" otherwise, distributed_c10d.py). A resident op called so returns
// none: a CUDA op is already ordered on the caller's stream, and a CPU op has been waited for
// before the call returns. That spares the caller the Work's Python object and the wait()
// binding with its GIL release and retake. Inside torch's
// allow_inflight_collective_as_graph_input context torch registers the Work with the tensors,
// so there one is returned. Reading that setting takes torch's registry lock (uncontended), as
// torch's own ProcessGroup dispatch does for every op; an asyncOp call skips it.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace resident {

inline bool synchronousCall(bool async_op) {
  return !async_op && !c10d::allow_inflight_collective_as_graph_input();
}

}  // namespace resident
