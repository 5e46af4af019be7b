"""vLLM plugin: decode-size tensor-parallel all-reduces on a ``resident`` group where it is the
better path (docs/vllm.md).

This package declares it as the ``vllm.general_plugins`` entry point ``resident``; vLLM calls
:func:`register` in each of its processes before any work. It does nothing unless
``RESIDENT_VLLM=1``: installing resident_pg never changes vLLM behind a user's back.

When enabled it checks that vLLM's classes still have the names and signatures it relies on
(:func:`check_vllm_api`, raising if not) and patches:

* ``GroupCoordinator.__init__``: after vLLM built its TP groups (``group_name == "tp"``), each
  rank decides for its own group (:func:`decide`), the ranks exchange their decisions over the
  world CPU group, and every rank creates a ``resident`` group for each TP group whose members
  all chose it (``new_group`` is collective over the world, so all ranks create the same groups
  in the same order, whether vLLM created its own with ``new_group`` or ``split_group``). A
  group is warmed up at once (its first op installs channels and registers memory, long before
  any CUDA graph capture) and handed to the coordinator's ``CudaCommunicator``;
* ``CudaCommunicator.all_reduce``: a contiguous input of at most ``RESIDENT_VLLM_MAX_BYTES``
  goes to the resident group, anything else keeps vLLM's own order. A CUDA input goes to the
  group's backend object itself (:func:`direct_all_reduce`), which is where ``dist.all_reduce``
  ends: torch's Python wrapper and op dispatch above it cost an eager op more host time than
  its launch (docs/performance.md); inside a CUDA graph both record the same kernel;
* ``CudaCommunicator.destroy`` destroys the resident group too; ``suspend`` / ``resume``
  (sleep mode) keep it (captured graphs reference its memory, which is pinned host memory and a
  few device words) and ``resume`` checks it with one all-reduce.

The policy (``RESIDENT_VLLM_ROUTE=auto``): resident takes a group's all-reduces on vLLM's CUDA
platform when the group spans hosts, or when none of vLLM's intra-node fast paths (NCCL
symmetric memory, quick all-reduce, FlashInfer, FlashInfer PCIe IPC, AITER, custom all-reduce,
torch symmetric memory) is active for it; otherwise vLLM's order stands. ``resident`` and
``vllm`` force either way. Checked against vLLM 0.33.0.
"""

from __future__ import annotations

import inspect
import logging
import os
from datetime import timedelta

ENABLE_VAR = "RESIDENT_VLLM"
MAX_BYTES_VAR = "RESIDENT_VLLM_MAX_BYTES"
TIMEOUT_VAR = "RESIDENT_VLLM_TIMEOUT_S"
ROUTE_VAR = "RESIDENT_VLLM_ROUTE"
DEFAULT_MAX_BYTES = 64 * 1024
DEFAULT_TIMEOUT_S = 1800
ROUTES = ("auto", "resident", "vllm")
TESTED_VLLM = "0.33.0"
_PATCHED = "_resident_patched"

# CudaCommunicator attributes of vLLM's fast paths ahead of (or instead of) pynccl, with the
# name vLLM's own backend log uses for each. NCCL symmetric memory has no object of its own.
FAST_PATH_ATTRS = {
    "qr_comm": "QUICK_REDUCE",
    "fi_pcie_ipc_ar_comm": "FLASHINFER_PCIE_IPC",
    "fi_ar_comm": "FLASHINFER",
    "aiter_ar_comm": "AITER_CUSTOM",
    "ca_comm": "CUSTOM",
    "symm_mem_comm": "SYMM_MEM",
}
_REQUIRED_ATTRS = tuple(FAST_PATH_ATTRS) + ("pynccl_comm", "use_aiter_allreduce")

logger = logging.getLogger("vllm.plugins.resident")


def enabled() -> bool:
    value = os.environ.get(ENABLE_VAR, "0").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"resident: {ENABLE_VAR} must be 0 or 1, got {value!r}")


def route_option() -> str:
    value = os.environ.get(ROUTE_VAR, "auto").strip().lower() or "auto"
    if value not in ROUTES:
        raise ValueError(f"resident: {ROUTE_VAR} must be one of {', '.join(ROUTES)}, got {value!r}")
    return value


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
    route = route_option()
    max_bytes = _positive_int(MAX_BYTES_VAR, DEFAULT_MAX_BYTES)
    timeout = timedelta(seconds=_positive_int(TIMEOUT_VAR, DEFAULT_TIMEOUT_S))
    try:
        import vllm
        from vllm.distributed import parallel_state
        from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator
    except ImportError as e:
        raise ImportError(
            f"resident: {ENABLE_VAR}=1 but vLLM's GroupCoordinator / CudaCommunicator could not "
            f"be imported ({e}); this plugin targets vLLM's CUDA platform") from e
    problems = check_vllm_api(parallel_state, CudaCommunicator)
    if problems:
        raise RuntimeError(f"resident: vLLM {vllm.__version__} differs from what the plugin patches "
                           f"(checked against {TESTED_VLLM}): " + "; ".join(problems))
    if getattr(vllm, "__version__", "") != TESTED_VLLM:
        logger.warning("resident: the vLLM plugin was checked against vLLM %s, this is %s",
                       TESTED_VLLM, vllm.__version__)
    patch(parallel_state.GroupCoordinator, CudaCommunicator, max_bytes=max_bytes,
          timeout=timeout, route=route)
    return True


def check_vllm_api(parallel_state, communicator_cls) -> list:
    """What differs in vLLM from the names and signatures the plugin relies on (empty: none)."""
    problems = []

    def params(fn):
        return list(inspect.signature(fn).parameters)

    coordinator = getattr(parallel_state, "GroupCoordinator", None)
    if coordinator is None:
        return ["vllm.distributed.parallel_state.GroupCoordinator is missing"]
    init = params(coordinator.__init__)
    for name in ("group_ranks", "local_rank", "torch_distributed_backend",
                 "use_device_communicator", "group_name"):
        if name not in init:
            problems.append(f"GroupCoordinator.__init__ has no argument {name!r} ({init})")
    for name in ("device_communicator", "cpu_group", "rank_in_group", "unique_name", "ranks"):
        if name not in inspect.getsource(coordinator.__init__):
            problems.append(f"GroupCoordinator.__init__ does not set {name!r}")
    for name in ("get_world_group", "in_the_same_node_as"):
        if not callable(getattr(parallel_state, name, None)):
            problems.append(f"vllm.distributed.parallel_state.{name} is missing")
    if params(communicator_cls.all_reduce) != ["self", "input_"]:
        problems.append(f"CudaCommunicator.all_reduce takes {params(communicator_cls.all_reduce)}, "
                        "not (self, input_)")
    for name in ("destroy", "suspend", "resume"):
        fn = getattr(communicator_cls, name, None)
        if fn is None or params(fn) != ["self"]:
            problems.append(f"CudaCommunicator.{name}(self) is missing or takes other arguments")
    source = inspect.getsource(communicator_cls.__init__)
    for name in _REQUIRED_ATTRS:
        if f"self.{name}" not in source:
            problems.append(f"CudaCommunicator.__init__ does not set {name!r}")
    all_reduce_source = inspect.getsource(communicator_cls.all_reduce)
    for name in ("should_nccl_symm_mem_allreduce",) + tuple(FAST_PATH_ATTRS):
        if name not in all_reduce_source:
            problems.append(f"CudaCommunicator.all_reduce no longer uses {name!r}")
    return problems


def platform_name() -> str:
    """vLLM's platform: ``cuda`` (NVIDIA), ``rocm``, or the platform class name."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        return "cuda"
    if current_platform.is_rocm():
        return "rocm"
    return type(current_platform).__name__


def group_spans_hosts(cpu_group) -> bool:
    """Whether the ranks of ``cpu_group`` are on more than one host, by vLLM's own test (the one
    that turns its custom all-reduce off). Collective over ``cpu_group``."""
    from vllm.distributed.parallel_state import in_the_same_node_as

    return not all(in_the_same_node_as(cpu_group, source_rank=0))


def world_cpu_group():
    """vLLM's world CPU (gloo) group, or torch's default group outside vLLM."""
    try:
        from vllm.distributed import parallel_state
    except ImportError:
        return None
    world = getattr(parallel_state, "_WORLD", None)
    return world.cpu_group if world is not None else None


def active_fast_paths(comm) -> list:
    """vLLM's intra-node all-reduce paths that are active on ``comm`` (a CudaCommunicator)."""
    active = []
    pynccl = getattr(comm, "pynccl_comm", None)
    if pynccl is not None and not getattr(pynccl, "disabled", True) and _nccl_symm_mem_active(comm):
        active.append("NCCL_SYMM_MEM")
    for attr, name in FAST_PATH_ATTRS.items():
        path = getattr(comm, attr, None)
        if path is None or getattr(path, "disabled", True):
            continue
        if attr == "aiter_ar_comm" and not getattr(comm, "use_aiter_allreduce", False):
            continue  # an AITER object kept for DP all-gather / reduce-scatter only
        active.append(name)
    return active


def _nccl_symm_mem_active(comm) -> bool:
    # The static conditions of vLLM's should_nccl_symm_mem_allreduce (the rest depends on size).
    try:
        import vllm.envs as envs
        from vllm.distributed.device_communicators.all_reduce_utils import (
            NCCL_SYMM_MEM_ALL_REDUCE_CONFIG as config,
        )
        from vllm.distributed.device_communicators.pynccl_allocator import (
            is_symmetric_memory_enabled,
        )
    except ImportError:
        return False
    size = comm.world_size
    return (is_symmetric_memory_enabled() and not envs.VLLM_BATCH_INVARIANT
            and size >= config["min_world_size"]
            and (size in config["custom_ar_preferred_ranges"]
                 or size > config["always_use_above_world_size"]))


def decide(route: str, platform: str, spans_hosts: bool, fast_paths: list) -> tuple:
    """(whether resident takes the group's small all-reduces, why)."""
    if route == "vllm":
        return False, f"{ROUTE_VAR}=vllm"
    if route == "resident":
        return True, f"{ROUTE_VAR}=resident"
    if platform != "cuda":
        return False, f"vLLM platform {platform}, not cuda"
    if spans_hosts:
        return True, "the group spans hosts"
    if fast_paths:
        return False, "vLLM's intra-node fast paths are active: " + ", ".join(fast_paths)
    return True, "no intra-node fast path of vLLM is active"


def patch(coordinator_cls, communicator_cls, *, max_bytes: int = DEFAULT_MAX_BYTES,
          timeout: timedelta = timedelta(seconds=DEFAULT_TIMEOUT_S), route: str = "auto") -> None:
    """Patches ``coordinator_cls.__init__`` and ``communicator_cls``'s ``all_reduce``,
    ``destroy``, ``suspend`` and ``resume`` (idempotent: plugins may be loaded several times)."""
    if route not in ROUTES:
        raise ValueError(f"resident: route must be one of {ROUTES}, got {route!r}")
    if getattr(coordinator_cls, _PATCHED, False):
        return
    import torch.distributed as dist

    import resident_pg  # noqa: F401  registers the backend "resident"

    orig_init = coordinator_cls.__init__
    signature = inspect.signature(orig_init)
    orig = {name: getattr(communicator_cls, name, None)
            for name in ("all_reduce", "destroy", "suspend", "resume")}

    def init(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        orig_init(self, *args, **kwargs)
        if bound.arguments.get("group_name") == "tp":
            group_ranks = [list(r) for r in bound.arguments["group_ranks"]]
            _attach(self, group_ranks, communicator_cls, route, timeout, max_bytes)

    def all_reduce(self, input_):
        group = self.__dict__.get("resident_group")
        if group is not None and routes_to_resident(self, input_, max_bytes):
            out = input_.clone()  # vLLM's all_reduce is out of place
            direct = self.__dict__.get("resident_direct")
            if direct is not None:
                direct(out)
            else:
                dist.all_reduce(out, group=group)  # one kernel on the current stream: capturable
            return out
        return orig["all_reduce"](self, input_)

    def destroy(self):
        self.__dict__.pop("resident_direct", None)
        group = self.__dict__.pop("resident_group", None)
        if group is not None:
            dist.destroy_process_group(group)
        if orig["destroy"] is not None:
            orig["destroy"](self)

    def suspend(self):
        if orig["suspend"] is not None:
            orig["suspend"](self)
        self.resident_suspended = True

    def resume(self):
        if orig["resume"] is not None:
            orig["resume"](self)
        group = self.__dict__.get("resident_group")
        if group is not None and self.__dict__.get("resident_suspended"):
            _warm_up(self, group)  # collective, as vLLM's resume: every member is awake
        self.resident_suspended = False

    coordinator_cls.__init__ = init
    communicator_cls.all_reduce = all_reduce
    communicator_cls.destroy = destroy
    communicator_cls.suspend = suspend
    communicator_cls.resume = resume
    setattr(coordinator_cls, _PATCHED, True)


def direct_limit(handoff: dict) -> float:
    """Messages below this many bytes stay resident (the group's hand-off, ``Backend.handoff()``,
    takes all-reduces from its crossover to another backend, whose Work must be waited on)."""
    if not handoff.get("on"):
        return float("inf")
    return handoff["crossover_bytes"]["all_reduce"] or float("inf")


def direct_all_reduce(group, device, max_bytes=float("inf")):
    """``call(t)``: sums ``t`` in place over ``group`` through its resident backend's own
    ``allreduce`` with ``asyncOp`` off — one kernel on the current stream, ordered there like any
    kernel; the call returns no Work — for messages of at most ``max_bytes``; None where
    that does not hold (CPU tensors, whose ops complete on the host; a torch whose
    ``AllreduceOptions`` has no ``asyncOp``; a group whose backend is not resident; a hand-off
    that takes some of those messages), so that the caller decides once, not per op."""
    import torch
    import torch.distributed as dist

    device = torch.device(device)
    if device.type != "cuda":
        return None
    opts = dist.AllreduceOptions()
    if not hasattr(opts, "asyncOp"):
        return None
    backend = group._get_backend(device)
    if not hasattr(backend, "handoff"):
        return None
    limit = direct_limit(backend.handoff())
    if limit != float("inf") and max_bytes >= limit:
        return None
    opts.reduceOp = dist.ReduceOp.SUM
    opts.asyncOp = False
    allreduce = backend.allreduce

    def call(t):
        allreduce([t], opts)

    return call


def _warm_up(comm, group) -> None:
    import torch
    import torch.distributed as dist

    device = getattr(comm, "device", None) or torch.device("cpu")
    dist.all_reduce(torch.zeros(1, device=device), group=group)


def _attach(coordinator, group_ranks, communicator_cls, route, timeout, max_bytes) -> None:
    """Decides for this rank's TP group, agrees with every rank, and creates the groups."""
    import torch.distributed as dist

    if all(len(ranks) < 2 for ranks in group_ranks):
        return  # no TP: vLLM has no device communicator either
    comm = getattr(coordinator, "device_communicator", None)
    mine = next(i for i, ranks in enumerate(group_ranks) if dist.get_rank() in ranks)
    if route != "vllm" and isinstance(comm, communicator_cls):
        platform = platform_name()
        spans = (route == "auto" and platform == "cuda"
                 and group_spans_hosts(coordinator.cpu_group))
        missing = [a for a in _REQUIRED_ATTRS if not hasattr(comm, a)]
        if route == "auto" and missing:
            raise RuntimeError(f"resident: vLLM's {type(comm).__name__} has no {missing}: "
                               f"the routing policy cannot tell whether its fast paths are active")
        use, reason = decide(route, platform, spans, active_fast_paths(comm))
    elif route == "vllm":
        use, reason = False, f"{ROUTE_VAR}=vllm"
    else:
        use, reason = False, f"vLLM's device communicator is {type(comm).__name__}"
    votes = [None] * dist.get_world_size()
    dist.all_gather_object(votes, (mine, use, reason), group=world_cpu_group())
    chosen = [all(votes[r][1] for r in ranks) for ranks in group_ranks]
    group = None
    for i, ranks in enumerate(group_ranks):
        if chosen[i]:
            g = dist.new_group(ranks, backend="resident", timeout=timeout)
            if i == mine:
                group = g
    if group is not None:
        _warm_up(comm, group)
        comm.resident_group = group
        comm.resident_direct = direct_all_reduce(group, getattr(comm, "device", None) or "cpu",
                                                 max_bytes)
        comm.resident_suspended = False
    if coordinator.rank_in_group == 0:
        reasons = sorted({votes[r][2] for r in group_ranks[mine]})
        logger.info("resident: TP group %s (ranks %s): all-reduces up to the size limit %s (%s)",
                    getattr(coordinator, "unique_name", "tp"), group_ranks[mine],
                    "go to resident" if chosen[mine] else "keep vLLM's path", "; ".join(reasons))


def routes_to_resident(comm, input_, max_bytes: int) -> bool:
    """Whether ``comm.all_reduce(input_)`` goes to ``comm``'s resident group (the group exists
    only where the policy chose resident): small and contiguous."""
    return input_.is_contiguous() and input_.numel() * input_.element_size() <= max_bytes
