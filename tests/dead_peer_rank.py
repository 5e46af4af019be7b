"""One rank of a dead-peer job (tests/test_dead_peer.py starts it as a plain subprocess, so the
test decides whether and when a killed rank is reaped).

argv: a JSON object: rank, world_size, store_port, scenario, device, victim, timeout_s, op
("all_reduce"; "ep": one resident_pg.ep.Buffer dispatch + combine; "recv": every other rank
receives from the victim, which sends to each).
Prints JSON lines on stdout: {"ready": ...} when the rank reached the point where it may be
killed (scenario "left": {"left": wall-clock time} once the victim destroyed its group), and, for a survivor, {"result": {...}} with the wall-clock time it raised and what the
group's Backend.get_error() said: between ops once the victim died (polled until it is no longer
SUCCESS, with the time), and after the op raised.
"""

import datetime
import json
import os
import sys
import time


def say(**kw):
    print(json.dumps(kw), flush=True)


def ep_step(rank, ws, device):
    """One EP decode step on the world group: Buffer dispatch + combine of 4 tokens, top-2 of
    2 experts per rank (on CUDA the counts travel with the rows on every path)."""
    import torch

    from resident_pg.ep import Buffer

    tokens, hidden, experts, top_k = 4, 64, 2 * ws, 2
    buf = Buffer(None, tokens, hidden, experts, torch.float32, device, num_topk=top_k)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=g).to(device)
    idx = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    idx = idx.to(device)
    weights = torch.rand(tokens, top_k, generator=g).to(device)

    def step(group=None):
        recv_x, _count, handle, _event, _hook = buf.low_latency_dispatch(x, idx, tokens, experts)
        out, _event, _hook = buf.low_latency_combine(recv_x, idx, weights, handle)
        if device == "cuda":
            out.cpu()  # the host learns of a failed op at the next call
        return out

    return step


def main():
    cfg = json.loads(sys.argv[1])
    rank, ws, victim = cfg["rank"], cfg["world_size"], cfg["victim"]
    scenario, device = cfg["scenario"], cfg["device"]
    import torch
    import torch.distributed as dist

    import resident_pg  # noqa: F401

    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.TCPStore("127.0.0.1", cfg["store_port"], None, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    timeout = datetime.timedelta(seconds=cfg["timeout_s"][rank])
    if scenario == "creation":
        if rank == victim:
            say(ready=True)  # killed a moment after it started creating the group
        else:
            time.sleep(1.5)  # the victim is dead by the time the others create theirs
    t_start = time.time()
    try:
        dist.init_process_group("resident", store=store, rank=rank, world_size=ws, timeout=timeout)
    except Exception as e:  # noqa: BLE001
        say(result={"raised": True, "t_raise": time.time(), "t_start": t_start,
                    "where": "init", "type": type(e).__name__, "message": str(e)})
        return
    if scenario == "creation":
        say(result={"raised": False, "where": "init"})
        return
    sub = dist.new_group([1, 2]) if scenario == "subgroup" else None

    def group_error(group=None):
        group = group if group is not None else dist.group.WORLD
        return group._get_backend(torch.device(device)).get_error().name

    x = torch.arange(1, 1 + 1031, dtype=torch.float32, device=device) * (rank + 1)

    def op(group=None):
        t = x.clone()
        dist.all_reduce(t, group=group)
        if device == "cuda":
            t.cpu()  # the host learns of a failed op at the next call
        return t

    if cfg.get("op") == "ep":
        op = ep_step(rank, ws, device)
    if cfg.get("op") == "recv":

        def op(group=None):
            t = x.clone()
            if rank == victim:
                for p in range(ws):
                    if p != victim:
                        dist.send(t, p)
            else:
                dist.recv(t, victim)
                if device == "cuda":
                    t.cpu()
            return t

    for _ in range(3):  # every rank warms up on every group it belongs to
        t = op()
        if sub is not None and rank in (1, 2):
            op(sub)
    if victim < 0:  # a healthy job: the GPU (and MPS) still serve a fresh job after a kill
        expected = torch.arange(1, 1 + 1031, dtype=torch.float64) * (ws * (ws + 1) // 2)
        got = t.cpu().double()
        same, error = torch.equal(got, expected), group_error()
        wrong = (got != expected).nonzero().flatten().tolist()
        dist.destroy_process_group()
        say(result={"raised": False, "healthy": same and error == "SUCCESS", "error": error,
                    "wrong_elements": len(wrong),
                    "first_wrong": [[i, got[i].item(), expected[i].item()] for i in wrong[:3]]})
        return
    if rank == victim:
        say(ready=True)
        if scenario == "left":
            # Destroys its group in order while the others wait inside an op it never joins;
            # stays alive (the parent kills it at the end).
            time.sleep(0.5)
            dist.destroy_process_group()
            say(left=time.time())
        time.sleep(600)  # stops calling; the parent kills it
        return
    if scenario == "stuck":
        # The victim stays alive but never calls: the rank with the short timeout gives up at
        # its timeout, and the others learn of it from that rank at once.
        say(ready=True)
    between = {}
    if scenario == "between_ops":
        # Outside any op while the victim dies: get_error() says so without an op, and the next
        # op must fail at once.
        while not os.path.exists(cfg["killed_marker"]):
            time.sleep(0.01)
        t_dead = time.time()
        error = group_error()
        while error == "SUCCESS" and time.time() < t_dead + 10:
            time.sleep(0.005)
            error = group_error()
        between = {"error_between": error, "error_between_s": time.time() - t_dead}
        time.sleep(0.3)
    t_start = time.time()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            op(sub if (scenario == "subgroup" and rank == 1) else None)
        say(result={"raised": False})
    except Exception as e:  # noqa: BLE001
        t_raise = time.time()
        group = sub if (scenario == "subgroup" and rank == 1) else None
        say(result={"raised": True, "t_raise": t_raise, "t_start": t_start, "where": "op",
                    "type": type(e).__name__, "message": str(e), "error": group_error(group),
                    **between})
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


if __name__ == "__main__":
    main()
