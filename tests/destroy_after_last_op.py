"""A job in which a rank destroys its group right after its last op while the others still
wait inside that op for its share (tests/test_faults.py on CPU tensors, tests/test_cuda_faults.py
on CUDA tensors).

Per cycle a new world: a checked warm-up all_reduce, then rank ``last`` (in turn) joins 20 ms
after the others — an all_reduce, or (``send``) a send to each other rank, which wait in recv —
and destroys its group as soon as the op has finished on its side; the others read get_error()
before destroying theirs. Every rank's result must be complete and every group healthy: leaving
in order sends what this rank's finished ops still owe (a CUDA kernel ends once it has its
peers' data, not once its own share is out). The late rank's proxy has backed off meanwhile
when the environment sets RESIDENT_PROXY_SPIN_US / RESIDENT_GPU_PROXY_SPIN_US to 0.
"""

from __future__ import annotations

import time

import dist_harness as H
from dist_harness import make_input

CYCLES = 6
N = 4099
SPIN_OFF = {"RESIDENT_PROXY_SPIN_US": "0", "RESIDENT_GPU_PROXY_SPIN_US": "0"}
MODES = {  # how the late rank's share leaves
    "shm": SPIN_OFF,
    "proxy": {"RESIDENT_PATH": "proxy", **SPIN_OFF},
    "tcp": {"RESIDENT_TRANSPORT": "tcp", **SPIN_OFF},
}


def job(rank, ws, op, device):
    """Runs the cycles; returns {"errors": [...]}."""
    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        torch.zeros(1, device="cuda").add_(1)  # the CUDA context exists before the group
    H.connect_store()
    out = {"errors": []}
    for c in range(CYCLES):
        H.init_pg(prefix=f"destroy_after_last_op{c}/", timeout_s=10)
        last = c % ws
        warm = [make_input(f"destroy/{c}/warm", r, N, "float32") for r in range(ws)]
        t = warm[rank].to(device, copy=True)
        dist.all_reduce(t)
        out["errors"] += H.compare_reduction(t.cpu(), H.reference_reduce(warm, "SUM", "float32"),
                                             warm, "SUM", "float32", f"cycle {c} warm-up")
        ins = [make_input(f"destroy/{op}/{c}", r, N, "float32") for r in range(ws)]
        t = ins[rank].to(device, copy=True)
        dist.barrier()
        if rank == last:
            time.sleep(0.02)  # the others wait inside the op; this rank's proxy backs off
        if op == "all_reduce":
            dist.all_reduce(t)
        elif rank == last:
            for peer in range(ws):
                if peer != last:
                    dist.send(t, peer)
        else:
            dist.recv(t, last)
        if device == "cuda":
            torch.cuda.synchronize()
        error = None
        if rank != last:
            error = dist.group.WORLD._get_backend(torch.device(device)).get_error().name
        dist.destroy_process_group()
        label = f"cycle {c} (rank {last} last)"
        if op == "all_reduce":
            ref = H.reference_reduce(ins, "SUM", "float32")
            out["errors"] += H.compare_reduction(t.cpu(), ref, ins, "SUM", "float32", label)
        else:
            out["errors"] += H.compare_exact(t.cpu(), ins[last], label)  # what last sent
        if error not in (None, "SUCCESS"):
            out["errors"].append(f"cycle {c}: get_error() {error} after rank {last} destroyed "
                                 "its group right after the op")
    return out


def run(op, mode, device, timeout_s=180):
    outcomes = H.run_ranks_collect(job, 3, args=(op, device), env=MODES[mode], init=False,
                                   init_timeout_s=30, timeout_s=timeout_s)
    return H.job_errors(outcomes)
