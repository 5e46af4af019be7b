// The EP kernels' entry points in resident_pg._C (kernels/ep_args.hpp), called by
// resident_pg.ep_kernels with tensors' addresses and the current stream.
#pragma once

#include <pybind11/pybind11.h>

namespace resident {

void bindEpKernels(pybind11::module_& m);

}  // namespace resident
