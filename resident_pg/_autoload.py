"""Registers the ``resident`` backend with torch.distributed without loading the extension.

This module is the target of the ``torch.backends`` and ``torch.distributed.backends`` entry
points, so ``dist.init_process_group(backend="resident")`` works without ``import
resident_pg``. It must stay tiny and must never raise: ``import torch`` calls it.
"""

BACKEND_NAME = "resident"
DEVICES = ["cpu", "cuda"]  # a list: register_backend iterates a string character by character


def _create(dist_backend_opts, backend_options):
    # Imported on first use: the extension loads only when a group is created.
    from resident_pg._backend import create_backend

    return create_backend(dist_backend_opts, backend_options)


def register():
    """Register the backend once; safe to call any number of times."""
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return
        if BACKEND_NAME.upper() in getattr(dist.Backend, "_plugins", {}):
            return
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=DEVICES)
    except Exception as err:  # noqa: BLE001 - never break `import torch`
        import os
        import sys

        if os.environ.get("RESIDENT_DEBUG"):
            print(f"[resident] backend registration skipped: {err!r}", file=sys.stderr)
