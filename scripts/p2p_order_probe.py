"""Runs the cases of tests/test_cuda_p2p_order.py (all but the graph case, which needs the
test harness's store) in two ranks on one GPU, printing each case's start, result and time,
so that a case that hangs shows where. A debugging aid for the GPU machine."""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))


def rank_main(rank, ws, port):
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    import resident_pg  # noqa: F401
    import test_cuda_p2p_order as T

    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        torch.zeros(1, device="cuda").add_(1)
    store = dist.TCPStore("127.0.0.1", port, ws, rank == 0)
    dist.init_process_group("resident", store=store, rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=20))
    for cid, case in T.CASES.items():
        if "graph" in cid:
            continue
        t0 = time.monotonic()
        print(f"rank {rank} {cid}: start", flush=True)
        try:
            errs, _ = case.fn(rank, ws)
            res = "ok" if not errs else f"{len(errs)} errors: {errs[:2]}"
        except Exception as e:  # noqa: BLE001
            res = f"raised {type(e).__name__}: {str(e)[:300]}"
        print(f"rank {rank} {cid}: {res} ({time.monotonic() - t0:.1f} s)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.start_processes(rank_main, args=(2, 29733), nprocs=2, start_method="spawn")
