"""vLLM plugin: decode-size tensor-parallel all-reduces on a ``resident`` group (docs/vllm.md).

This package declares it as the ``vllm.general_plugins`` entry point ``resident``, so vLLM calls
:func:`register` in each of its processes before any work. It does nothing unless
``RESIDENT_VLLM=1``: installing resident_pg never changes vLLM behind a user's back.

When enabled it patches two vLLM classes:

* ``GroupCoordinator.__init__``: while vLLM creates its TP groups (``group_name == "tp"``), every
  rank also creates a ``resident`` group over the same ranks (``new_group`` is collective, so all
  ranks create all of them, in the same order), runs one all-reduce on it at once (the first op
  installs the channels and registers memory: long before any CUDA graph capture), and hands the
  group to the coordinator's device communicator;
* ``CudaCommunicator.all_reduce``: a contiguous input of at most ``RESIDENT_VLLM_MAX_BYTES``
  (default 64 KiB) goes to the resident group when vLLM's custom all-reduce is not in use; the
  rest (prefill-size tensors, NVLink custom all-reduce inside a node) keeps vLLM's own path.

The patch sits below ``torch.ops.vllm.all_reduce``, so it applies eager, under ``torch.compile``
and inside captured graphs alike. Checked against vLLM's class and argument names as of its
0.8–0.11 sources (``GroupCoordinator(group_ranks, local_rank, torch_distributed_backend,
use_device_communicator, ..., group_name)``, ``CudaCommunicator.all_reduce(input_)``,
``ca_comm``); tests/test_vllm_plugin.py runs it against stand-ins of those classes — it has not
run inside vLLM (not installable here).
"""

from __future__ import annotations

import inspect
import os
from datetime import timedelta

ENABLE_VAR = "RESIDENT_VLLM"
MAX_BYTES_VAR = "RESIDENT_VLLM_MAX_BYTES"
TIMEOUT_VAR = "RESIDENT_VLLM_TIMEOUT_S"
DEFAULT_MAX_BYTES = 64 * 1024
DEFAULT_TIMEOUT_S = 1800
_PATCHED = "_resident_patched"


def enabled() -> bool:
    value = os.environ.get(ENABLE_VAR, "0").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"resident: {ENABLE_VAR} must be 0 or 1, got {value!r}")


def _positive_int(var: str, default: int) -> int:
    raw = os.environ.get(var)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value <= 0:
        raise ValueError(f"resident: {var} must be a positive integer, got {raw!r}")
    return value


def register() -> bool:
    """vLLM's plugin hook. Returns whether it patched vLLM (False when not enabled)."""
    if not enabled():
        return False
    try:
        from vllm.distributed import parallel_state
        from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator
    except ImportError as e:
        raise ImportError(
            f"resident: {ENABLE_VAR}=1 but vLLM's GroupCoordinator / CudaCommunicator could not "
            f"be imported ({e}); this plugin targets vLLM's CUDA platform") from e
    patch(parallel_state.GroupCoordinator, CudaCommunicator,
          max_bytes=_positive_int(MAX_BYTES_VAR, DEFAULT_MAX_BYTES),
          timeout=timedelta(seconds=_positive_int(TIMEOUT_VAR, DEFAULT_TIMEOUT_S)))
    return True


def patch(coordinator_cls, communicator_cls, *, max_bytes: int = DEFAULT_MAX_BYTES,
          timeout: timedelta = timedelta(seconds=DEFAULT_TIMEOUT_S)) -> None:
    """Patches ``coordinator_cls.__init__`` and ``communicator_cls.all_reduce`` (idempotent:
    plugins may be loaded several times in one process)."""
    if getattr(coordinator_cls, _PATCHED, False):
        return
    import torch
    import torch.distributed as dist

    import resident_pg  # noqa: F401  registers the backend "resident"

    orig_init = coordinator_cls.__init__
    signature = inspect.signature(orig_init)
    orig_all_reduce = communicator_cls.all_reduce

    def init(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        mine = None
        if bound.arguments.get("group_name") == "tp":
            for ranks in bound.arguments["group_ranks"]:
                group = dist.new_group(list(ranks), backend="resident", timeout=timeout)
                if dist.get_rank() in ranks:
                    mine = group
        orig_init(self, *args, **kwargs)
        comm = getattr(self, "device_communicator", None)
        if mine is not None and comm is not None:
            device = getattr(comm, "device", None) or torch.device("cpu")
            dist.all_reduce(torch.zeros(1, device=device), group=mine)
            comm.resident_group = mine

    def all_reduce(self, input_):
        group = getattr(self, "resident_group", None)
        if group is not None and routes_to_resident(self, input_, max_bytes):
            out = input_.clone()  # vLLM's all_reduce is out of place
            dist.all_reduce(out, group=group)  # one kernel on the current stream: capturable
            return out
        return orig_all_reduce(self, input_)

    coordinator_cls.__init__ = init
    communicator_cls.all_reduce = all_reduce
    setattr(coordinator_cls, _PATCHED, True)


def routes_to_resident(comm, input_, max_bytes: int) -> bool:
    """Whether ``comm.all_reduce(input_)`` goes to the resident group: small, contiguous, and
    vLLM's custom all-reduce (NVLink inside a node, faster than any host-memory path) off."""
    custom = getattr(comm, "ca_comm", None)
    if custom is not None and not getattr(custom, "disabled", True):
        return False
    return input_.is_contiguous() and input_.numel() * input_.element_size() <= max_bytes
