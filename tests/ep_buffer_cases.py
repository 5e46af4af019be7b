"""resident_pg.ep.Buffer's dispatch and combine inside a rank (the cases of test_ep.py's jobs).

low_latency_dispatch / low_latency_combine over the device-splits exchange (transport
``splits``), the padded all_to_all_single (``padded``) and a gloo group (the fallback, ``auto``),
in rounds of random routings (ep_scenarios.EP_SCENARIOS): the received rows and counts bitwise
against ep_scenarios.ep_reference, the combined output of stand-in experts within the payload
dtype's rounding, and whether CUDA dispatch sends its counts with its rows.  Dispatch + experts +
combine captured once, replayed with fresh routings.  ``error_cases``: bad calls of
all_to_all_device_splits and Buffer raise (ValueError; NotImplementedError for what is not
implemented) before communicating.

The stand-in expert of global id ``e`` multiplies its rows by ``ep_reference.expert_scale(e)``.
``expert_scales``, ``check_combined`` and ``graph_replays`` serve the FP8 cases too
(ep_fp8_cases.py).
"""

from __future__ import annotations

import numpy as np

import dist_harness as H
from ep_reference import expert_scale
from ep_scenarios import ep_params, ep_reference, ep_routing, ep_tokens, ep_weights
from ep_splits_cases import capture, dev

_SCALES: dict = {}


def expert_scales(device, rank, L):
    """[L, 1, 1] float32: expert_scale of each local expert's global id, made on the first call
    (eager, before any capture: a graph cannot copy from pageable host memory) and reused."""
    import torch

    key = (str(device), rank, L)
    if key not in _SCALES:
        _SCALES[key] = torch.tensor([expert_scale(rank * L + l) for l in range(L)],
                                    dtype=torch.float32, device=device).view(L, 1, 1)
    return _SCALES[key]


def graph_replays(fill, step, check, device, replays, key, label):
    """A graph program: ``fill(key)`` the static inputs, ``step()`` once eagerly and checked,
    captured, then replayed ``replays`` times with fresh inputs, each checked; the errors."""
    fill(f"{key}/warm")
    step()
    errs = check(f"{key}/warm", f"{label}graph warm-up")
    replay = capture(step, device)
    for i in range(replays):
        fill(f"{key}/{i}")
        replay()
        errs += check(f"{key}/{i}", f"{label}replay {i}")
    return errs


def _expert(recv_x, rank, L):
    """A stand-in expert: local expert l scales its rows by expert_scale(its global id)."""
    return (recv_x.float() * expert_scales(recv_x.device, rank, L)).to(recv_x.dtype)


def check_combined(y, ref_y, tol, label):
    """The combined output against its reference, within ``tol`` (per element)."""
    got_y = y.double().cpu().numpy()
    if got_y.shape != ref_y.shape:
        return [f"{label}: combined shape {got_y.shape} != {ref_y.shape}"]
    if (np.abs(got_y - ref_y) > tol).any():
        i = np.unravel_index(np.argmax(np.abs(got_y - ref_y) - tol), tol.shape)
        return [f"{label}: combined[{i}] = {got_y[i]!r}, reference {ref_y[i]!r}"]
    return []


def _check_ep(name, ws, rank, rnd, key, recv_x, recv_count, y, label, Ts=None):
    import torch

    ref_x, ref_count, ref_y, tol = ep_reference(name, ws, rank, rnd, key, Ts)
    errs = []
    got_count = recv_count.cpu().numpy()
    if recv_count.dtype != torch.int32 or not np.array_equal(got_count, ref_count):
        errs.append(f"{label}: recv_count {got_count.tolist()} ({recv_count.dtype}) != "
                    f"{ref_count.tolist()}")
    got_x = recv_x.double().cpu().numpy()
    if got_x.shape != ref_x.shape or not np.array_equal(got_x, ref_x):
        where = np.argwhere(got_x != ref_x)[0].tolist() if got_x.shape == ref_x.shape else None
        errs.append(f"{label}: recv_x {got_x.shape} differs from the reference {ref_x.shape} "
                    f"(first at [expert, row, col] {where})")
    return errs + check_combined(y, ref_y, tol, label)


def ep_case(rank, ws, device, name, transport, group=None):
    import torch

    from resident_pg.ep import Buffer, EventOverlap

    dt, L, E, Hd, M, K, rounds, mode = ep_params(name, ws)
    dtype = H.tdtype(dt)
    buf = Buffer(group, M, Hd, E, dtype, device, transport=transport)
    want = "padded" if transport == "auto" else transport
    errs = [] if buf.transport == want else [f"transport {buf.transport!r}, expected {want!r}"]
    for rnd, Ts in enumerate(rounds):
        key = f"ep/{name}/{rnd}"
        T = Ts[rank]
        x = dev(ep_tokens(key, rank, T, Hd, dt), dtype, device)
        idx = dev(ep_routing(key, rank, T, E, K, mode), torch.int64, device)
        w = dev(ep_weights(key, rank, T, K), torch.float32, device)
        recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(
            x, idx, M, E, async_finish=True, return_recv_hook=True)
        if rnd == 0 and buf.transport == "splits":
            errs += _counts_with_rows_errors(buf, K, device)
        if not isinstance(event, EventOverlap) or not callable(hook):
            errs.append(f"round {rnd}: dispatch returned event {event!r}, hook {hook!r}")
        event.current_stream_wait()
        hook()
        got_x, got_count = recv_x.clone(), recv_count.clone()
        y, event, hook = buf.low_latency_combine(_expert(recv_x, rank, L), idx, w, handle)
        if hook is not None:
            errs.append(f"round {rnd}: combine without return_recv_hook returned a hook")
        errs += _check_ep(name, ws, rank, rnd, key, got_x, got_count, y,
                          f"{transport} round {rnd}")
    return errs


def _counts_with_rows_errors(buf, K, device):
    """Dispatch sends its counts with its rows on CUDA where a peer's capacity is at most the
    bound of the job's path: over tcp the network's, else the one-host bound."""
    import os

    from resident_pg import ep

    d = buf._dispatchers[(K, "activations")]
    cap = d.slots_per_rank * d.dispatch_row_bytes()
    tcp = os.environ.get("RESIDENT_TRANSPORT") == "tcp"
    bound = ep.COUNTS_WITH_ROWS_MAX_BYTES_NETWORK if tcp else ep.COUNTS_WITH_ROWS_MAX_BYTES
    want = device == "cuda" and cap <= bound
    got = d.exchange_with_counts is not None
    if got == want:
        return []
    return [f"capacity {cap} B per peer{' over tcp' if tcp else ''}: counts with the rows "
            f"{got}, expected {want}"]


def ep_graph_case(rank, ws, device, replays):
    """Dispatch + experts + combine captured once, replayed with fresh routings."""
    import torch

    from resident_pg.ep import Buffer

    name = "random_bf16"
    dt, L, E, Hd, M, K, _, mode = ep_params(name, ws)
    dtype = H.tdtype(dt)
    buf = Buffer(None, M, Hd, E, dtype, device, num_topk=K)
    x = torch.zeros(M, Hd, dtype=dtype, device=device)
    idx = torch.zeros(M, K, dtype=torch.int64, device=device)
    w = torch.zeros(M, K, dtype=torch.float32, device=device)
    res = {}

    def step():
        recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E)
        res["x"], res["count"] = recv_x, recv_count
        res["y"] = buf.low_latency_combine(_expert(recv_x, rank, L), idx, w, handle)[0]

    def fill(key):
        x.copy_(dev(ep_tokens(key, rank, M, Hd, dt), dtype, device))
        idx.copy_(dev(ep_routing(key, rank, M, E, K, mode), torch.int64, device))
        w.copy_(dev(ep_weights(key, rank, M, K), torch.float32, device))

    def check(key, label):  # M tokens on every rank
        return _check_ep(name, ws, rank, 0, key, res["x"], res["count"], res["y"], label,
                         [M] * ws)

    return graph_replays(fill, step, check, device, replays, "ep/graph", "")


def error_cases(rank, ws):
    import torch
    import torch.distributed as dist

    from resident_pg.ep import Buffer, all_to_all_device_splits, resident_backend

    res = {}

    def expect(label, fn, fragment, exc=ValueError):
        H.expect_error(res, label, fn, fragment, exc)

    buf3 = torch.zeros(ws, 3, 4)
    rows = torch.zeros(ws, dtype=torch.int64)
    a2a = all_to_all_device_splits
    expect("shape", lambda: a2a(torch.zeros(ws + 1, 3, 4), torch.zeros(ws + 1, 3, 4), rows, rows),
           "shape")
    expect("1d", lambda: a2a(torch.zeros(ws), torch.zeros(ws), rows, rows), "shape")
    expect("out_shape", lambda: a2a(torch.zeros(ws, 2, 4), buf3, rows, rows), "output has shape")
    expect("out_dtype", lambda: a2a(buf3.double(), buf3, rows, rows), "dtype")
    expect("rows_float", lambda: a2a(buf3.clone(), buf3, rows.float(), rows.float()), "int32")
    expect("rows_len", lambda: a2a(buf3.clone(), buf3, rows[:-1], rows[:-1]),
           "one count per rank")
    expect("rows_3d", lambda: a2a(buf3.clone(), buf3, rows.view(ws, 1, 1), rows.view(ws, 1, 1)),
           "[ws, n]".replace("ws", str(ws)))
    none = torch.zeros(ws, 0, dtype=torch.int64)
    expect("rows_no_parts", lambda: a2a(buf3.clone(), buf3, none, none), "summed")
    parts2, parts3 = torch.zeros(ws, 2, dtype=torch.int64), torch.zeros(ws, 3, dtype=torch.int64)
    expect("rows_shape_mix", lambda: a2a(buf3.clone(), buf3, parts2, parts3), "one shape")
    expect("rows_strided", lambda: a2a(buf3.clone(), buf3, parts2.t().contiguous().t(), parts2),
           "contiguous")
    expect("rows_mix", lambda: a2a(buf3.clone(), buf3, rows, rows.int()), "one dtype")
    expect("not_tensor", lambda: a2a(buf3.clone(), buf3, [0] * ws, rows), "tensor")
    backend = resident_backend(None, "cpu")
    expect("counts_out_cpu", lambda: backend.all_to_all_device_splits(
        buf3.clone(), buf3, rows, rows.clone(), False, True), "counts_out needs CUDA")
    gloo = dist.new_group(backend="gloo")
    expect("gloo", lambda: a2a(buf3.clone(), buf3, rows, rows, group=gloo), "resident")
    expect("transport", lambda: Buffer(None, 4, 8, 2 * ws, transport="fast"), "transport")
    expect("splits_on_gloo", lambda: Buffer(gloo, 4, 8, 2 * ws, device="cpu",
                                            transport="splits"), "resident")
    expect("experts", lambda: Buffer(None, 4, 8, 2 * ws + 1, device="cpu"), "multiple")
    buf = Buffer(None, 4, 8, 2 * ws, torch.float32, "cpu")
    x, idx = torch.zeros(2, 8), torch.tensor([[0, 1], [-1, 2 * ws - 1]])
    expect("fp8_hidden", lambda: buf.low_latency_dispatch(x, idx, 4, 2 * ws, use_fp8=True),
           "multiple of 128")
    expect("round_scale_without_fp8", lambda: buf.low_latency_dispatch(x, idx, 4, 2 * ws,
                                                                       round_scale=True),
           "use_fp8")
    buf8 = Buffer(None, 4, 256, 2 * ws, torch.bfloat16, "cpu")
    x8 = torch.zeros(2, 256, dtype=torch.bfloat16)
    expect("ue8m0_without_round", lambda: buf8.low_latency_dispatch(
        x8, idx, 4, 2 * ws, use_fp8=True, use_ue8m0=True), "round_scale")
    expect("ue8m0_hidden", lambda: buf8.low_latency_dispatch(
        x8, idx, 4, 2 * ws, use_fp8=True, round_scale=True, use_ue8m0=True), "multiple of 512")
    expect("fp8_x_dtype", lambda: buf8.low_latency_dispatch(x8.float(), idx, 4, 2 * ws,
                                                            use_fp8=True), "dtype")
    expect("fp8_x_hidden", lambda: buf8.low_latency_dispatch(x8[:, :128], idx, 4, 2 * ws,
                                                             use_fp8=True), "[T, 256]")
    expect("fp8_too_many", lambda: buf8.low_latency_dispatch(
        torch.zeros(5, 256, dtype=torch.bfloat16), torch.zeros(5, 2, dtype=torch.int64), 4,
        2 * ws, use_fp8=True), "num_max_dispatch_tokens_per_rank")
    expect("fp8_int_dtype", lambda: Buffer(None, 4, 256, 2 * ws, torch.int32, "cpu",
                                           num_topk=2, use_fp8=True), "activations")
    expect("max_tokens", lambda: buf.low_latency_dispatch(x, idx, 5, 2 * ws), "num_max")
    expect("num_experts", lambda: buf.low_latency_dispatch(x, idx, 4, 2 * ws + 2), "num_experts")
    expect("too_many", lambda: buf.low_latency_dispatch(torch.zeros(5, 8),
                                                        torch.zeros(5, 2, dtype=torch.int64),
                                                        4, 2 * ws), "max_tokens")
    # a valid round trip afterwards: nothing above communicated
    rx, rc, h, _, _ = buf.low_latency_dispatch(x, idx, 4, 2 * ws)
    expect("combine_idx", lambda: buf.low_latency_combine(rx, idx[:1], torch.ones(2, 2), h),
           "topk_idx")
    expect("combine_handle", lambda: buf.low_latency_combine(rx, idx, torch.ones(2, 2), None),
           "handle")
    expect("logfmt", lambda: buf.low_latency_combine(rx, idx, torch.ones(2, 2), h,
                                                     use_logfmt=True), "logfmt",
           NotImplementedError)
    y = buf.low_latency_combine(rx, idx, torch.ones(2, 2), h)[0]
    res["valid_after_errors"] = "ok" if tuple(y.shape) == (2, 8) else f"shape {tuple(y.shape)}"
    return res
