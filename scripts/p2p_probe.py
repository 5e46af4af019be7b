"""Two ranks on one GPU: blocking send/recv ping-pong of a few sizes, then irecv posted before
isend on both ranks, eager, each checked;
with RESIDENT_DEBUG=debug the log shows where every send/recv kernel was launched. Used on
the GPU machine to look at the CUDA send/recv path in isolation."""

import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank, ws, port):
    import resident_pg  # noqa: F401

    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", port, ws, rank == 0)
    dist.init_process_group("resident", store=store, rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=20))
    bad = 0
    for n in (2, 1024, 16384):
        for it in range(3):
            t = torch.full((n,), -6.0, device="cuda")
            if rank == 0:
                t.copy_(torch.arange(n, dtype=torch.float32, device="cuda") + it)
                dist.send(t, 1)
                dist.recv(t, 1)
                want = torch.arange(n, dtype=torch.float32) + it + 1
            else:
                dist.recv(t, 0)
                t.add_(1)
                dist.send(t, 0)
                want = torch.arange(n, dtype=torch.float32) + it + 1
            got = t.cpu()
            ok = torch.equal(got, want)
            bad += not ok
            print(f"rank {rank} n={n} it={it}: {'ok' if ok else 'WRONG'} first={got[:3].tolist()}",
                  flush=True)
    # Both ranks post the irecv first, then the isend; the waits in both orders.
    peer = 1 - rank
    for n in (2, 1024, 262147):
        for order in (0, 1):
            mine = torch.arange(n, dtype=torch.float32, device="cuda") * (rank + 2) + order
            buf = torch.full((n,), -6.0, device="cuda")
            print(f"rank {rank} irecv-first n={n} order={order}: posting", flush=True)
            wr = dist.irecv(buf, src=peer)
            ws_ = dist.isend(mine, dst=peer)
            for w in ((wr, ws_) if order == 0 else (ws_, wr)):
                w.wait()
            want = torch.arange(n, dtype=torch.float32) * (peer + 2) + order
            got = buf.cpu()
            ok = torch.equal(got, want)
            bad += not ok
            print(f"rank {rank} irecv-first n={n} order={order}: {'ok' if ok else 'WRONG'} "
                  f"first={got[:3].tolist()}", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    mp.start_processes(rank_main, args=(2, 29731), nprocs=2, start_method="spawn")
