"""The large-message hand-off (docs/handoff.md): a resident group owns an NCCL backend and hands
it the CUDA ops whose message reaches RESIDENT_HANDOFF_BYTES, where NCCL can serve the group.

At creation every rank publishes one record through the group's store (its
RESIDENT_HANDOFF_BYTES, its GPU's UUID, or why it cannot run NCCL) and reads all of them, so
that every rank takes the same decision: on, or off with one reason for all.
"""

from __future__ import annotations

import json
import os
import socket

# The op kinds the hand-off covers (csrc/c10d/handoff.hpp), in its order.
OPS = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
       "all_to_all_single", "send_recv")
# The kinds the gloo stand-in takes: gloo has no AVG or PREMUL_SUM, so a test that issues those
# may leave the reductions resident.
STANDIN_OPS = OPS
_KEY = "resident_handoff"
STANDIN_VAR = "RESIDENT_HANDOFF_CPU_STANDIN"
_logged = set()  # reasons already logged by this process


def _log_once(message):
    if message not in _logged:
        _logged.add(message)
        from resident_pg import _C

        _C._log_info(message)


def local_record(crossover, device_index=None):
    """This rank's record: its crossover bytes and its GPU, or why it cannot run NCCL."""
    import torch
    import torch.distributed as dist

    record = {"bytes": int(crossover), "gpu": None, "missing": None}
    if int(crossover) == 0:
        return record  # off here: the GPU is not touched (no CUDA context for a CPU-only rank)
    if not dist.is_nccl_available():
        record["missing"] = "torch was built without NCCL"
    elif not torch.cuda.is_available():
        record["missing"] = "no CUDA device"
    else:
        index = torch.cuda.current_device() if device_index is None else device_index
        props = torch.cuda.get_device_properties(index)
        record["gpu"] = str(getattr(props, "uuid", "")) or (
            f"{socket.gethostname()}/pci {props.pci_domain_id:04x}:"
            f"{props.pci_bus_id:02x}:{props.pci_device_id:02x}")
    return record


def decide(records, one_rank_per_gpu=True):
    """(crossover bytes, None) when the group hands off, else (0, reason); records in rank order.

    The same records give the same answer on every rank.
    """
    values = sorted({r["bytes"] for r in records})
    if len(values) > 1:
        return 0, f"the ranks' RESIDENT_HANDOFF_BYTES differ ({', '.join(map(str, values))})"
    if values[0] == 0:
        return 0, "RESIDENT_HANDOFF_BYTES=0"
    for rank, r in enumerate(records):
        if r["missing"]:
            return 0, f"rank {rank} cannot run NCCL: {r['missing']}"
    first = {}
    for rank, r in enumerate(records if one_rank_per_gpu else ()):
        if r["gpu"] in first:
            return 0, (f"ranks {first[r['gpu']]} and {rank} share GPU {r['gpu']}; NCCL needs one "
                       "rank per GPU")
        first[r["gpu"]] = rank
    return values[0], None


def exchange(store, rank, size, record):
    """Every rank's record, in rank order (each rank publishes its own)."""
    store.set(f"{_KEY}/rank{rank}", json.dumps(record))
    keys = [f"{_KEY}/rank{r}" for r in range(size)]
    store.wait(keys)
    return [json.loads(v) for v in store.multi_get(keys)]


def _bound_device_index(dist_backend_opts):
    pg = getattr(dist_backend_opts, "process_group", None)
    device = getattr(pg, "bound_device_id", None) if pg is not None else None
    return device.index if device is not None and device.type == "cuda" else None


def _make_nccl(store, rank, size, timeout, group_name, global_ranks, device_index):
    import torch
    import torch.distributed as dist

    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    if group_name:
        options.group_name = f"{group_name}:{_KEY}"
    if global_ranks:
        options.global_ranks_in_group = list(global_ranks)
    nccl = dist.ProcessGroupNCCL(dist.PrefixStore(f"{_KEY}/nccl/", store), rank, size, options)
    if device_index is not None and hasattr(nccl, "bound_device_id"):
        nccl.bound_device_id = torch.device("cuda", device_index)
    return nccl


def cpu_standin():
    """RESIDENT_HANDOFF_CPU_STANDIN: 'off' or 'gloo'."""
    value = os.environ.get(STANDIN_VAR, "off").strip().lower() or "off"
    if value not in ("off", "gloo"):
        raise ValueError(f"resident: {STANDIN_VAR} must be off or gloo, got {value!r}")
    return value


def _set_up_cpu_standin(pg, store, rank, size, timeout):
    records = exchange(store, rank, size, {"bytes": pg.handoff_bytes(), "gpu": None,
                                           "missing": None})
    crossover, reason = decide(records, one_rank_per_gpu=False)
    if reason is not None:
        pg._set_handoff_off(reason)
        return
    import torch.distributed as dist

    gloo = dist.ProcessGroupGloo(dist.PrefixStore(f"{_KEY}/gloo/", store), rank, size, timeout)
    pg._set_handoff(gloo, "cpu", {op: crossover for op in STANDIN_OPS})
    _log_once(f"hand-off of CPU tensors to the gloo stand-in on: ops from {crossover} bytes")


def set_up(pg, dist_backend_opts, timeout, global_ranks):
    """Gives the new backend `pg` its NCCL hand-off for CUDA tensors, or the reason it has none.

    torch makes one backend for all devices of a group whose devices all name resident (the
    usual ``backend="resident"``), on the store of the first device, so a backend cannot tell
    from its store whether CUDA tensors will reach it: every resident backend sets up the
    hand-off (ProcessGroupNCCL makes its communicator only on its first op).
    """
    store = dist_backend_opts.store
    rank, size = dist_backend_opts.group_rank, dist_backend_opts.group_size
    if cpu_standin() == "gloo":
        _set_up_cpu_standin(pg, store, rank, size, timeout)
        return
    if pg.handoff_bytes() == 0:
        # Every rank's setting is the same (group creation checked it): none exchanges.
        pg._set_handoff_off("RESIDENT_HANDOFF_BYTES=0")
        return
    device_index = _bound_device_index(dist_backend_opts)
    records = exchange(store, rank, size, local_record(pg.handoff_bytes(), device_index))
    crossover, reason = decide(records)
    if reason is not None:
        pg._set_handoff_off(reason)
        _log_once(f"hand-off to NCCL off: {reason}")
        return
    nccl = _make_nccl(store, rank, size, timeout, getattr(dist_backend_opts, "group_id", ""),
                      global_ranks, device_index)
    pg._set_handoff(nccl, "cuda", {op: crossover for op in OPS})
    _log_once(f"hand-off to NCCL on: ops from {crossover} bytes")


def _set_handoff(group, inner, crossover_bytes, device="cpu"):
    """Test-only: hands `group`'s ops on `device` tensors from `crossover_bytes` (an int for
    every op kind, or a dict per kind) to the backend `inner`, e.g. a ProcessGroupGloo as a
    stand-in for NCCL on CPU. Call it on every rank alike, before the group's next op."""
    import torch

    if device not in ("cpu", "cuda"):
        raise ValueError(f"resident: hand-off device {device!r} is not 'cpu' or 'cuda'")
    backend = group._get_backend(torch.device(device))
    if isinstance(crossover_bytes, int):
        crossover_bytes = {op: crossover_bytes for op in OPS}
    backend._set_handoff(inner, device, dict(crossover_bytes))
