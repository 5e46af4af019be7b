"""Where does a one-way CUDA send/recv spend its time? Two ranks on one GPU (MPS), eager
ping-pong (rank 0: send, recv; rank 1: recv, send) with CUDA events between the ops on the
stream; per size, the median GPU time of each op on each rank, and the round trip. A send's
time is its kernel (credit wait, stores); a recv's time runs from the end of the rank's
previous op to the last line read, so it holds the peer's whole half of the round trip."""

import datetime
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank, ws, port, sizes, iters):
    import resident_pg  # noqa: F401

    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", port, ws, rank == 0)
    dist.init_process_group("resident", store=store, rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=30))
    peer = 1 - rank
    for n_bytes in sizes:
        n = max(1, n_bytes // 4)
        t = torch.randn(n, device="cuda")
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3 * iters)]
        dist.barrier()
        for i in range(iters):
            e0, e1, e2 = ev[3 * i:3 * i + 3]
            e0.record()
            if rank == 0:
                dist.send(t, peer)
                e1.record()
                dist.recv(t, peer)
            else:
                dist.recv(t, peer)
                e1.record()
                dist.send(t, peer)
            e2.record()
        torch.cuda.synchronize()
        first = [ev[3 * i].elapsed_time(ev[3 * i + 1]) * 1e3 for i in range(5, iters)]
        second = [ev[3 * i + 1].elapsed_time(ev[3 * i + 2]) * 1e3 for i in range(5, iters)]
        whole = [ev[3 * i].elapsed_time(ev[3 * i + 2]) * 1e3 for i in range(5, iters)]
        a, b = ("send", "recv") if rank == 0 else ("recv", "send")
        print(f"rank {rank} {n_bytes:>8} B: {a} {statistics.median(first):7.2f} us  "
              f"{b} {statistics.median(second):7.2f} us  round trip {statistics.median(whole):7.2f} us",
              flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main():
    sizes = [int(s) for s in os.environ.get("P2P_TIMELINE_SIZES", "8,4096,16384,65536,262144").split(",")]
    iters = int(os.environ.get("P2P_TIMELINE_ITERS", "60"))
    mp.start_processes(rank_main, args=(2, 29533, sizes, iters), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    sys.exit(main())
