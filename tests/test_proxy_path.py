"""The proxy path end to end through torch.distributed: RESIDENT_PATH=proxy (env) and
pg_options={"path": "proxy"} make every write go through the resident proxy thread, the
cross-node path, with the shm transport playing the NIC. Random data, independent references."""

import pytest
import torch
import torch.distributed as dist

import dist_harness as H

pytestmark = pytest.mark.skipif(H.BACKEND != "resident", reason="resident-only")


def _proxy_job(rank, ws):
    import resident_pg

    info = resident_pg.describe()
    paths = {p: v["path"] for p, v in info["peers"].items() if p != rank}
    g = torch.Generator().manual_seed(1234)
    inputs = [torch.randn(100_003, generator=g) for _ in range(ws)]  # > one 64 KiB slot
    x = inputs[rank].clone()
    dist.all_reduce(x)
    ref = inputs[0].clone()
    for r in range(1, ws):
        ref += inputs[r]
    ok_reduce = torch.equal(x, ref)
    ints = [torch.randint(-1000, 1000, (4096,), generator=torch.Generator().manual_seed(r),
                          dtype=torch.int64) for r in range(ws)]
    out = torch.empty(4096 * ws, dtype=torch.int64)
    dist.all_gather_into_tensor(out, ints[rank])
    ok_gather = torch.equal(out, torch.cat(ints))
    # p2p ring with a large message, crossing isend/irecv.
    big = torch.arange(300_000, dtype=torch.int32) * (rank + 1)
    got = torch.empty_like(big)
    reqs = [dist.isend(big, (rank + 1) % ws, tag=7), dist.irecv(got, (rank - 1) % ws, tag=7)]
    for r in reqs:
        r.wait()
    ok_p2p = torch.equal(got, torch.arange(300_000, dtype=torch.int32) * (((rank - 1) % ws) + 1))
    # A group with the option given per group instead of the environment.
    sub = dist.new_group(list(range(ws)), backend="resident", pg_options={"path": "direct"})
    sub_paths = {p: v["path"] for p, v in resident_pg.describe(sub)["peers"].items() if p != rank}
    y = inputs[rank].clone()
    dist.all_reduce(y, group=sub)
    return {"paths": paths, "sub_paths": sub_paths, "reduce": ok_reduce, "gather": ok_gather,
            "p2p": ok_p2p, "sub_reduce": torch.equal(y, ref)}


@pytest.mark.parametrize("ws", [2, 3])
def test_proxy_path_end_to_end(ws):
    results = H.run_ranks(_proxy_job, ws, env={"RESIDENT_PATH": "proxy"}, timeout_s=120)
    for rank, res in enumerate(results):
        assert set(res["paths"].values()) == {"proxy"}, res
        assert set(res["sub_paths"].values()) == {"direct"}, res
        assert res["reduce"] and res["gather"] and res["p2p"] and res["sub_reduce"], (rank, res)
