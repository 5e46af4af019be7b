"""Build of resident_pg: one extension, resident_pg._C.

The torch-free core (csrc/core) and the c10d adapter (csrc/c10d) are C++17. CUDA device code
(kernels/*.cu) is compiled with nvcc when there is any and nvcc is found; the core never
needs it.
"""

import glob
import os
import shutil

from setuptools import setup

# torch guesses CUDA_HOME from the nvcc on PATH, which may be a wrapper script outside the
# toolkit (/usr/local/bin/nvcc); fall back to the standard toolkit location then.
def _has_headers(home):
    return bool(home) and os.path.exists(os.path.join(home, "include", "cuda_runtime_api.h"))


if not _has_headers(os.environ.get("CUDA_HOME")):
    _nvcc = shutil.which("nvcc")
    for _home in (os.path.dirname(os.path.dirname(os.path.realpath(_nvcc))) if _nvcc else "",
                  "/usr/local/cuda"):
        if _has_headers(_home):
            os.environ["CUDA_HOME"] = _home
            break
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, CUDA_HOME

ROOT = os.path.dirname(os.path.abspath(__file__))


def sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))


cuda = sources("kernels/*.cu")
use_cuda = bool(cuda) and CUDA_HOME is not None and os.environ.get("RESIDENT_NO_CUDA") != "1"
# The CUDA path: device code (kernels/), its torch-free host side (csrc/cuda) and the adapter's
# CUDA Work (csrc/c10d/work_cuda.cpp); without nvcc, csrc/c10d/no_cuda.cpp stands in.
skip = "csrc/c10d/no_cuda.cpp" if use_cuda else "csrc/c10d/work_cuda.cpp"
# csrc/core with its concept folders (transport/, transport/ib/, proxy/).
cpp = [
    s
    for s in sources("csrc/core/**/*.cpp") + sources("csrc/c10d/*.cpp")
    if s != skip
]
if use_cuda:
    cpp += sources("csrc/cuda/*.cpp")

common = dict(
    name="resident_pg._C",
    include_dirs=[os.path.join(ROOT, "csrc"), os.path.join(ROOT, "kernels")],
    extra_compile_args={
        # No -std here: torch picks the standard its headers need (C++17 for 2.11, C++20 for
        # 2.14). The core itself is C++17 and its unit tests build it with -std=c++17.
        "cxx": ["-O2", "-Wall", "-Wno-unused-parameter"],
        "nvcc": ["-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90",
                 "-gencode=arch=compute_90,code=compute_90"],
    },
    libraries=["rt", "dl"],  # dl: libibverbs is loaded at run time
)
if use_cuda:
    ext = CUDAExtension(sources=cpp + cuda, **common)
else:
    common["extra_compile_args"] = common["extra_compile_args"]["cxx"]
    ext = CppExtension(sources=cpp, **common)

setup(
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
