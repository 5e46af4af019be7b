"""Quick end-to-end check of the CUDA path: N ranks as processes on the visible GPU(s),
a few ops eager and graph-replayed, compared with a reference; prints per-op times.

    python scripts/gpu_smoke.py [--ranks 2] [--path direct|proxy]

A development tool (the test suite is tests/test_cuda_*.py); run it under MPS when the ranks
share one GPU.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank, world, port, path, q):
    os.environ["RESIDENT_PATH"] = path
    import resident_pg  # noqa: F401

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("resident", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    dev = torch.device("cuda", torch.cuda.current_device())
    out = []
    try:
        # point-to-point: blocking pairs and a ring, multi-round sizes, repeated
        for n in (1, 16384, 131075) * 3:
            peer = rank ^ 1
            g = torch.Generator().manual_seed(n)
            xs = [torch.randn(n, generator=g, dtype=torch.float64) for _ in range(world)]
            buf = torch.empty(n, dtype=torch.float64, device=dev)
            if peer < world:
                if rank % 2 == 0:
                    dist.send(xs[rank].to(dev), dst=peer)
                    dist.recv(buf, src=peer)
                else:
                    dist.recv(buf, src=peer)
                    dist.send(xs[rank].to(dev), dst=peer)
                assert torch.equal(buf.cpu(), xs[peer]), f"pair n={n}"
            left, right = (rank - 1) % world, (rank + 1) % world
            w1 = dist.irecv(buf, src=left)
            w2 = dist.isend(xs[rank].to(dev), dst=right)
            w1.wait()
            w2.wait()
            assert torch.equal(buf.cpu(), xs[left]), f"ring n={n}"
        out.append("p2p pairs + ring (8 B .. 1 MiB+24 B, x3) ok")
        if os.environ.get("SMOKE_P2P_ONLY"):
            q.put((rank, "ok", out))
            return
        for n in (2, 1024, 16384, 300000):
            g = torch.Generator().manual_seed(n)
            xs = [torch.randn(n, generator=g) for _ in range(world)]
            x = xs[rank].to(dev)
            dist.all_reduce(x)
            ref = sum(xs)
            err = (x.cpu() - ref).abs().max().item()
            out.append(f"all_reduce f32 n={n}: max err {err:.2e}")
            assert err < 1e-3, err
            ag = torch.empty(n * world, device=dev)
            dist.all_gather_into_tensor(ag, xs[rank].to(dev))
            assert torch.equal(ag.cpu(), torch.cat(xs)), "all_gather"
        # p2p ring
        t = torch.arange(1000, device=dev, dtype=torch.int64) + rank
        r = torch.empty_like(t)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, (rank + 1) % world),
                                       dist.P2POp(dist.irecv, r, (rank - 1) % world)])
        for q_ in reqs:
            q_.wait()
        assert torch.equal(r.cpu(), torch.arange(1000) + (rank - 1) % world), "p2p"
        out.append("p2p ring ok")
        # graph: 8 B all_reduce x 100
        s = torch.full((2,), float(rank + 1), device=dev)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dist.all_reduce(s)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        k = 100
        with torch.cuda.graph(graph):
            for _ in range(k):
                dist.all_reduce(s)
        for size in (2, 16384):
            pass
        s.fill_(1.0)
        graph.replay()
        torch.cuda.synchronize()
        expect = float(world) ** k
        out.append(f"graph 100x all_reduce: {s[0].item()} expect {expect}")
        times = []
        for _ in range(20):
            s.fill_(0.0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) / k * 1e6)
        times.sort()
        out.append(f"graph 8 B all_reduce per op: median {times[len(times)//2]:.2f} us")
        e = torch.zeros(2, device=dev)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(1000):
            dist.all_reduce(e)
        torch.cuda.synchronize()
        out.append(f"eager 8 B all_reduce per op: {(time.perf_counter() - t0) * 1e3:.2f} us")
        q.put((rank, "ok", out))
    except Exception as ex:  # report, then exit
        import traceback
        q.put((rank, "error", out + [traceback.format_exc()]))
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--path", default="direct")
    ap.add_argument("--port", type=int, default=29531)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args.ranks, args.port, args.path, q))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    ok = True
    for _ in procs:
        try:
            rank, status, lines = q.get(timeout=120)
        except Exception:
            print("timeout waiting for ranks")
            ok = False
            break
        print(f"[rank {rank} {args.path}] {status}")
        for line in lines:
            print("   ", line)
        ok &= status == "ok"
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
            ok = False
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
