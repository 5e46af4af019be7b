"""FP8 dispatch of resident_pg.ep.Buffer inside a rank (the cases of test_ep.py's jobs).

``use_fp8`` (with ``round_scale``; with ``use_ue8m0``) over the device-splits exchange, the
padded all_to_all_single and a gloo group (ep_scenarios.EP_FP8_SCENARIOS): the received fp8
bytes and scales compare bitwise with a numpy quantization of the routed rows
(ep_scenarios.ep_fp8_reference), the scales in their column-major layout, dequantized values
within fp8 rounding of the inputs, combine of the stand-in experts' outputs on the dequantized
rows, and an activation-dtype dispatch on the same Buffer afterwards.  FP8 dispatch + experts +
combine captured once, replayed with fresh tokens and routings.
"""

from __future__ import annotations

import numpy as np

import dist_harness as H
from ep_buffer_cases import check_combined, expert_scales, graph_replays
from ep_reference import fp8_tokens, fp8_values, ue8m0_packed
from ep_scenarios import EP_FP8_SCENARIOS, ep_fp8_reference, ep_routing, ep_weights, fp8_params
from ep_splits_cases import catch, dev


def _expert_fp8(recv_x, rank, L, dtype):
    """The stand-in expert on FP8 rows: dequantize (float32), scale by expert_scale, round to
    the activation dtype."""
    from resident_pg.ep_fp8 import dequantize

    x, scales = recv_x
    return (dequantize(x, scales) * expert_scales(x.device, rank, L)).to(dtype)


def _check_ep_fp8(name, ws, rank, key, recv_x, recv_count, y, label, Ts=None):
    import torch

    dt, L, E, Hd, M, K, _, _, _, ue = fp8_params(name, ws)
    codes, scales, ref_count, rows, ref_y, tol = ep_fp8_reference(name, ws, rank, key, Ts)
    S, G = ws * M, Hd // 128
    errs = []
    if not isinstance(recv_x, tuple) or len(recv_x) != 2:
        return [f"{label}: recv_x is {type(recv_x).__name__}, expected (x_fp8, scales)"]
    x8, sc = recv_x
    want_sc = (torch.int32, (L, S, G // 4)) if ue else (torch.float32, (L, S, G))
    if x8.dtype != torch.float8_e4m3fn or tuple(x8.shape) != (L, S, Hd):
        return [f"{label}: x_fp8 is {x8.dtype}{tuple(x8.shape)}, expected float8_e4m3fn"
                f"{(L, S, Hd)}"]
    if (sc.dtype, tuple(sc.shape)) != want_sc:
        return [f"{label}: scales are {sc.dtype}{tuple(sc.shape)}, expected {want_sc}"]
    if sc.stride() != (want_sc[1][2] * S, 1, S):
        errs.append(f"{label}: scales strides {sc.stride()}: not column-major in the last two "
                    "dimensions")
    got_count = recv_count.cpu().numpy()
    if not np.array_equal(got_count, ref_count):
        errs.append(f"{label}: recv_count {got_count.tolist()} != {ref_count.tolist()}")
    got_codes = x8.view(torch.uint8).cpu().numpy()
    if not np.array_equal(got_codes, codes):
        errs.append(f"{label}: fp8 bytes differ from the reference first at [expert, row, col] "
                    f"{np.argwhere(got_codes != codes)[0].tolist()}")
    if ue:
        got_sc, want = sc.cpu().numpy().view(np.uint32), ue8m0_packed(scales)
    else:
        got_sc, want = sc.cpu().numpy().view(np.uint32), scales.view(np.uint32)
    if not np.array_equal(got_sc, want):
        errs.append(f"{label}: scales differ from the reference first at [expert, row, group] "
                    f"{np.argwhere(got_sc != want)[0].tolist()}")
    # the received values are the inputs within fp8 rounding (relative 2**-4, or half the
    # subnormal step 2**-10 times the scale)
    if not errs:
        for l in range(L):
            n = int(ref_count[l])
            s_full = np.repeat(scales[l, :n].astype(np.float64), 128, axis=1)
            deq = fp8_values(got_codes[l, :n]) * s_full
            bound = np.abs(rows[l, :n]) * 2.0 ** -4 * (1 + 2.0 ** -20) + s_full * 2.0 ** -10
            if (np.abs(deq - rows[l, :n]) > bound).any():
                i = np.unravel_index(np.argmax(np.abs(deq - rows[l, :n]) - bound), bound.shape)
                errs.append(f"{label}: expert {l} row {i}: dequantized {deq[i]!r} is not within "
                            f"fp8 rounding of the input {rows[l, :n][i]!r}")
                break
    return errs + check_combined(y, ref_y, tol, label)


def _ep_fp8_case(rank, ws, device, name, transport, group=None):
    """FP8 dispatch + combine, then an activation-dtype dispatch of the same tokens on the same
    Buffer (both formats side by side)."""
    import torch

    from resident_pg.ep import Buffer

    dt, L, E, Hd, M, K, Ts, mode, rs, ue = fp8_params(name, ws)
    dtype = H.tdtype(dt)
    key = f"ep/{name}"
    buf = Buffer(group, M, Hd, E, dtype, device, transport=transport)
    T = Ts[rank]
    x = dev(fp8_tokens(key, rank, T, Hd, dt), dtype, device)
    idx = dev(ep_routing(key, rank, T, E, K, mode), torch.int64, device)
    w = dev(ep_weights(key, rank, T, K), torch.float32, device)
    recv_x, recv_count, handle, event, _ = buf.low_latency_dispatch(
        x, idx, M, E, use_fp8=True, round_scale=rs, use_ue8m0=ue, async_finish=True)
    event.current_stream_wait()
    got = (recv_x[0].clone(), recv_x[1].clone()) if isinstance(recv_x, tuple) else recv_x
    y, _, _ = buf.low_latency_combine(_expert_fp8(recv_x, rank, L, dtype), idx, w, handle)
    errs = _check_ep_fp8(name, ws, rank, key, got, recv_count.clone(), y, f"{transport} fp8")
    # the same tokens in the activation dtype: the rows arrive unchanged
    plain_x, plain_count, _, _, _ = buf.low_latency_dispatch(x, idx, M, E)
    _, _, ref_count, rows, _, _ = ep_fp8_reference(name, ws, rank, key)
    if not (np.array_equal(plain_x.double().cpu().numpy(), rows) and
            np.array_equal(plain_count.cpu().numpy(), ref_count)):
        errs.append(f"{transport}: activation dispatch after FP8 dispatch differs from the "
                    "reference rows")
    return errs


def ep_fp8_graph_case(rank, ws, device, name, replays):
    """FP8 dispatch + experts + combine captured once, replayed with fresh tokens / routings."""
    import torch

    from resident_pg.ep import Buffer

    dt, L, E, Hd, M, K, _, mode, rs, ue = fp8_params(name, ws)
    dtype = H.tdtype(dt)
    buf = Buffer(None, M, Hd, E, dtype, device, num_topk=K, use_fp8=True, use_ue8m0=ue)
    x = torch.zeros(M, Hd, dtype=dtype, device=device)
    idx = torch.zeros(M, K, dtype=torch.int64, device=device)
    w = torch.zeros(M, K, dtype=torch.float32, device=device)
    res = {}

    def step():
        recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(
            x, idx, M, E, use_fp8=True, round_scale=rs, use_ue8m0=ue)
        res["x"], res["count"] = recv_x, recv_count
        y = _expert_fp8(recv_x, rank, L, dtype)
        res["y"] = buf.low_latency_combine(y, idx, w, handle)[0]

    def fill(key):
        x.copy_(dev(fp8_tokens(key, rank, M, Hd, dt), dtype, device))
        idx.copy_(dev(ep_routing(key, rank, M, E, K, mode), torch.int64, device))
        w.copy_(dev(ep_weights(key, rank, M, K), torch.float32, device))

    def check(key, label):  # M tokens on every rank
        return _check_ep_fp8(name, ws, rank, key, res["x"], res["count"], res["y"], label,
                             [M] * ws)

    return graph_replays(fill, step, check, device, replays, f"ep/{name}/graph", "fp8 ")


def fp8_cases(rank, ws, device, gloo=None):
    """Every FP8 scenario over the device-splits and padded exchanges (and ``gloo``, when given):
    {case id: problems}."""
    out = {}
    for name in EP_FP8_SCENARIOS:
        for transport in ("splits", "padded"):
            out[f"fp8[{name}-{transport}]"] = catch(_ep_fp8_case, rank, ws, device, name,
                                                    transport)
        if gloo is not None:
            out[f"fp8[{name}-gloo]"] = catch(_ep_fp8_case, rank, ws, device, name, "auto", gloo)
    return out
