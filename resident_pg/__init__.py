"""resident_pg: a torch.distributed backend for decode-size messages.

``import resident_pg`` loads the extension and registers the backend ``resident`` for CPU
(and, in later builds, CUDA) tensors::

    import torch.distributed as dist
    import resident_pg  # optional: an entry point registers the backend anyway
    dist.init_process_group(backend="resident")

Configuration: RESIDENT_* environment variables or ``pg_options={...}`` (see docs/tuning.md).
"""

# Nothing heavy at import time: torch's entry points import this package while torch itself is
# still importing. The extension (resident_pg._C) loads when the first group is created.
from resident_pg._autoload import BACKEND_NAME, register

__version__ = "0.1.0"

register()


def _backend_of(group=None, device="cpu"):
    import torch
    import torch.distributed as dist

    from resident_pg import _C

    group = group if group is not None else dist.group.WORLD
    backend = group._get_backend(torch.device(device))
    if not isinstance(backend, _C.ProcessGroupResident):
        raise ValueError(f"resident: the group's {device} backend is {type(backend).__name__}, "
                         "not resident")
    return backend


def describe(group=None, device="cpu"):
    """How this rank reaches each peer of ``group``: transport and path, plus the config, the
    address:port its tcp peers connect to (None without any) and the large-message hand-off
    (docs/handoff.md: on or off and why, the crossover bytes and the count of ops handed off,
    per op kind)."""
    import torch.distributed as dist

    backend = _backend_of(group, device)
    size = dist.get_world_size(group)
    return {
        "rank": dist.get_rank(group),
        "size": size,
        "peers": {p: {"transport": backend.transport_for(p), "path": backend.path_for(p)}
                  for p in range(size)},
        "config": backend.config(),
        "proxy_cpu": backend.proxy_cpu(),
        "tcp_endpoint": backend.tcp_endpoint() or None,
        "handoff": backend.handoff(),
    }


__all__ = ["BACKEND_NAME", "describe", "register", "__version__"]
