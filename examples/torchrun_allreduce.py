"""Smallest end-to-end use of the resident backend.

    torchrun --nproc-per-node 2 examples/torchrun_allreduce.py

Every rank all-reduces random data, checks the sum against a locally computed reference,
prints how it reaches its peers, then times back-to-back 8-byte all-reduces.
"""

import time

import torch
import torch.distributed as dist


def main():
    dist.init_process_group(backend="resident")
    rank, world = dist.get_rank(), dist.get_world_size()
    import resident_pg

    if rank == 0:
        print(resident_pg.describe(), flush=True)
    inputs = [torch.randn(1000, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    x = inputs[rank].clone()
    dist.all_reduce(x)
    reference = inputs[0].clone()
    for r in range(1, world):
        reference += inputs[r]
    assert torch.equal(x, reference), "all_reduce result differs from the reference"
    small = torch.ones(2)
    for _ in range(1000):
        dist.all_reduce(small)
    n = 20000
    start = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(small)
    elapsed = (time.perf_counter() - start) / n * 1e6
    print(f"rank {rank}: all_reduce ok; 8 B all_reduce {elapsed:.2f} us per op", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
