"""resident_pg.ep_vllm's prepare/finalize inside a rank, for a class that ep_vllm makes over the
stand-ins (ep_vllm_standins.py) or over vLLM's own base class (ep_vllm_layers.vllm_job).

Every scenario of ep_vllm_scenarios.py over the resident group (the device-splits exchange) and a
gloo group (the padded all_to_all_single), through ``prepare``/``finalize`` and
``prepare_async``/``finalize_async`` in alternate rounds, against the numpy reference: the
batched rows and counts bitwise (FP8: the bytes and the scales, with their column-major layout),
the output within the payload dtype's rounding.  The error cases: refused options and
quantization configs raise, naming what is refused, before communicating.  Also the stand-in
jobs of test_ep_vllm.py and the parent's reading of a job's results.
"""

from __future__ import annotations

import numpy as np

import cuda_harness as C
import dist_harness as H
from ep_reference import ue8m0_packed
from ep_vllm_scenarios import (
    FP8_FORMATS,
    REFUSED_KINDS,
    SCENARIOS,
    WS,
    expert_scale,
    physical_of,
    reference,
    routing,
    tokens,
    weights,
)
from ep_vllm_standins import ExpertsTakingUe8m0, standin_interface, standin_quant_configs

# the error cases of _error_cases without the stand-in's dual-batch switch: 12, and each refused
# kind through an FP8 and an unquantized dispatch
N_ERROR_CASES = 12 + 2 * len(REFUSED_KINDS)


def to_torch(a, dtype, device="cpu"):
    import torch

    return torch.as_tensor(np.ascontiguousarray(a)).to(device=device, dtype=dtype)


def _experts(bx, rank, L):
    """Stand-in experts on the batched layout: local expert l scales its rows by
    expert_scale(its physical id)."""
    import torch

    s = torch.tensor([expert_scale(rank * L + l) for l in range(L)], dtype=torch.float32,
                     device=bx.device)
    return (bx.float() * s.view(L, 1, 1)).to(bx.dtype)


def dequantized(x_fp8, scales):
    """The test's float32 values of FP8 rows: each code's value times its group's scale
    (float32 scales, or UE8M0 bytes packed four per int32, group 4j+b in byte b: 2**(byte-127))."""
    import torch

    if scales.dtype == torch.int32:
        exps = torch.stack([(scales >> (8 * b)) & 0xFF for b in range(4)], dim=-1).flatten(-2)
        scales = (exps << 23).view(torch.float32)
    return x_fp8.float() * scales.repeat_interleave(128, dim=-1)


def _experts_fp8(x_fp8, scales, rank, L, dtype):
    """Stand-in block-FP8 experts: dequantize (float32), scale by expert_scale, round to the
    activation dtype."""
    import torch

    s = torch.tensor([expert_scale(rank * L + l) for l in range(L)], dtype=torch.float32,
                     device=x_fp8.device)
    return (dequantized(x_fp8, scales) * s.view(L, 1, 1)).to(dtype)


def _check_fp8_rows(label, fmt, a1q, a1q_scale, ref, shape):
    """(x_fp8, scales) against the reference: dtypes, shapes, the scales' column-major layout,
    the bytes and the scales bitwise."""
    import torch

    L, S, Hd = shape
    G = Hd // 128
    errs = []
    if a1q.dtype != torch.float8_e4m3fn or tuple(a1q.shape) != shape:
        return [f"{label}: a1q is {a1q.dtype}{tuple(a1q.shape)}, expected float8_e4m3fn{shape}"]
    want = (torch.int32, (L, S, G // 4)) if fmt == "ue8m0" else (torch.float32, (L, S, G))
    if not isinstance(a1q_scale, torch.Tensor) or \
            (a1q_scale.dtype, tuple(a1q_scale.shape)) != want:
        got = None if a1q_scale is None else (a1q_scale.dtype, tuple(a1q_scale.shape))
        return [f"{label}: a1q_scale is {got}, expected {want}"]
    if a1q_scale.stride() != (want[1][2] * S, 1, S):
        errs.append(f"{label}: a1q_scale strides {a1q_scale.stride()}: not column-major in the "
                    "last two dimensions")
    got_codes = a1q.view(torch.uint8).cpu().numpy()
    if not np.array_equal(got_codes, ref["codes"]):
        errs.append(f"{label}: fp8 bytes differ from the reference first at [expert, row, col] "
                    f"{np.argwhere(got_codes != ref['codes'])[0].tolist()}")
    got_sc = a1q_scale.cpu().numpy().view(np.uint32)
    want_sc = ue8m0_packed(ref["scales"]) if fmt == "ue8m0" else ref["scales"].view(np.uint32)
    if not np.array_equal(got_sc, want_sc):
        errs.append(f"{label}: scales differ from the reference first at [expert, row, group] "
                    f"{np.argwhere(got_sc != want_sc)[0].tolist()}")
    return errs


def _adapter_case(rank, cls, iface, quants, name, group, device):
    """All rounds of a scenario through ``cls`` on ``device``'s tensors; returns problems."""
    import torch

    from resident_pg.ep import Buffer

    dt, L, Hd, M, K, rounds, on_input, g2p, fmt = SCENARIOS[name]
    E, dtype = L * WS, H.tdtype(dt)
    buf = Buffer(group, M, Hd, E, dtype, device, num_topk=K)
    perm = physical_of(E)
    pf = cls(buf, global_to_physical=to_torch(perm, torch.int64, device) if g2p else None,
             use_fp8_dispatch=fmt in FP8_FORMATS)
    pf.post_init_setup(ExpertsTakingUe8m0(fmt == "ue8m0"))
    quant = quants["fp8_block128" if fmt in ("fp8", "ue8m0") else "none"]
    errs = []
    # the resident group moves the rows with the device-splits exchange, gloo the padded buffers
    if buf.transport != ("splits" if group is None else "padded"):
        errs.append(f"{name}: Buffer transport {buf.transport!r} on {buf.device}")
    facts = (pf.activation_format, pf.max_num_tokens_per_rank(), pf.num_dispatchers(),
             pf.topk_indices_dtype(), pf.output_is_reduced(), pf.supports_async(),
             pf.use_ue8m0_dispatch)
    if facts != (iface.batched_format, M, WS, torch.int64, True, True, fmt == "ue8m0"):
        errs.append(f"{name}: properties {facts}")
    for rnd, Ts in enumerate(rounds):
        key, T = f"ep_vllm/{name}/{rnd}", Ts[rank]
        x = to_torch(tokens(key, rank, T, Hd, dt, fmt), dtype, device)
        x_before = x.clone()
        idx = to_torch(routing(key, rank, T, E, K), torch.int64, device)
        w = to_torch(weights(key, rank, T, K), torch.float32, device)
        use_async = rnd % 2 == 1
        args = (x, w, idx, E, None, on_input, quant)
        if use_async:
            hook, receiver = pf.prepare_async(*args)
            hook()
            bx, scales, meta, ids, tw = receiver()
        else:
            bx, scales, meta, ids, tw = pf.prepare(*args, defer_input_quant=False)
        label = f"{name} round {rnd} ({'async' if use_async else 'sync'}, {buf.transport})"
        ref = reference(name, rank, rnd, key)
        counts = meta.expert_num_tokens
        if (ids, tw, meta.expert_num_tokens_cpu) != (None, None, None):
            errs.append(f"{label}: prepare returned ids/weights {ids, tw}")
        if counts.dtype != torch.int32 or counts.tolist() != ref["count"].tolist():
            errs.append(f"{label}: counts {counts.tolist()} ({counts.dtype}) != "
                        f"{ref['count'].tolist()}")
        if fmt in ("fp8", "ue8m0"):
            errs += _check_fp8_rows(label, fmt, bx, scales, ref, (L, WS * M, Hd))
            fused = _experts_fp8(bx, scales, rank, L, dtype)
        else:
            if scales is not None:
                errs.append(f"{label}: prepare returned scales {scales}")
            got_x = bx.double().cpu().numpy()
            if bx.dtype != dtype or got_x.shape != ref["x"].shape or \
                    not np.array_equal(got_x, ref["x"]):
                errs.append(f"{label}: batched x {bx.dtype}{got_x.shape} differs from the "
                            "reference")
            fused = _experts(bx, rank, L)
        if not torch.equal(x, x_before):
            errs.append(f"{label}: prepare modified a1")
        out = torch.full((T, Hd), -5.0, dtype=dtype, device=device)
        fargs = (out, fused, w, idx, on_input, iface.delegate())
        if use_async:
            hook, receiver = pf.finalize_async(*fargs)
            hook()
            receiver()
        else:
            pf.finalize(*fargs)
        got_y, ref_y, tol = out.double().cpu().numpy(), ref["y"], ref["tol"]
        if (np.abs(got_y - ref_y) > tol).any():
            i = np.unravel_index(np.argmax(np.abs(got_y - ref_y) - tol), tol.shape)
            errs.append(f"{label}: output[{i}] = {got_y[i]!r}, reference {ref_y[i]!r}")
    return errs


def _error_cases(rank, cls, iface, dbo, quants):
    import torch

    from resident_pg.ep import Buffer

    res = {}

    def expect(label, fn, fragment, exc):
        H.expect_error(res, label, fn, fragment, exc)

    L, E = 2, 2 * WS
    none = quants["none"]
    buf = Buffer(None, 4, 8, E, torch.float32, "cpu", num_topk=2)
    pf = cls(buf)
    x, w = torch.ones(3, 8), torch.full((3, 2), 0.5)
    idx = torch.tensor([[0, E - 1], [1, -1], [2, 3]])
    args = (x, w, idx, E, None, False)
    expect("buffer", lambda: cls(object()), "resident_pg.ep.Buffer", TypeError)
    expect("g2p", lambda: cls(buf, global_to_physical=torch.zeros(E)), "global_to_physical",
           ValueError)
    expect("defer", lambda: pf.prepare(*args, none, True), "defer_input_quant",
           NotImplementedError)
    expect("on_input_topk2", lambda: pf.prepare(x, w, idx, E, None, True, none, False),
           "top-1", ValueError)
    expect("finalize_first", lambda: pf.finalize(torch.empty(3, 8), torch.empty(L, 4 * WS, 8),
                                                 w, idx, False, iface.delegate()),
           "without a prepare", RuntimeError)
    wrong_map = torch.arange(E, dtype=torch.int32)  # every expert local: not Buffer's layout
    expect("expert_map", lambda: pf.prepare(x, w, idx, E, wrong_map, False, none, False),
           "expert_map", ValueError)
    if dbo is not None:  # the stand-in's switch; vLLM's own needs its ubatch threads
        dbo["on"] = True
        expect("dbo", lambda: pf.prepare(*args, none, False), "dual-batch",
               NotImplementedError)
        dbo["on"] = False
    # FP8 dispatch: the Buffer's rows must be quantizable, UE8M0 packs four groups per int32,
    # and only block-FP8 with 128-channel blocks and dynamic scales (or unquantized experts)
    # is served
    expect("fp8_hidden", lambda: cls(buf, use_fp8_dispatch=True), "multiple of 128",
           ValueError)
    buf8 = Buffer(None, 4, 256, E, torch.bfloat16, "cpu", num_topk=2)
    pf8 = cls(buf8, use_fp8_dispatch=True)
    expect("ue8m0_hidden", lambda: pf8.post_init_setup(ExpertsTakingUe8m0(True)),
           "multiple of 512", ValueError)
    x8 = torch.ones(3, 256, dtype=torch.bfloat16)
    for kind, fragment in REFUSED_KINDS.items():
        expect(f"fp8_dispatch_{kind}", lambda q=quants[kind]: pf8.prepare(
            x8, w, idx, E, None, False, q, False), fragment, NotImplementedError)
        expect(f"unquantized_dispatch_{kind}", lambda q=quants[kind]: pf.prepare(
            *args, q, False), fragment, NotImplementedError)
    expect("fp8_block128_without_fp8_dispatch", lambda: pf.prepare(
        *args, quants["fp8_block128"], False), "use_fp8_dispatch=True", NotImplementedError)
    # valid round trips afterwards (nothing above communicated), with a matching expert map
    right_map = torch.full((E,), -1, dtype=torch.int32)
    right_map[rank * L:(rank + 1) * L] = torch.arange(L, dtype=torch.int32)
    bx, _, meta, _, _ = pf.prepare(x, w, idx, E, right_map, False, none, False)
    expect("reduce_impl", lambda: pf.finalize(torch.empty(3, 8), bx.clone(), w, idx, False,
                                              object()), "TopKWeightAndReduceDelegate",
           ValueError)
    out = torch.zeros(3, 8)
    pf.finalize(out, bx.clone(), w, idx, False, iface.delegate())
    # every token's routed experts return it unchanged: output = sum of its routed weights
    want = torch.tensor([1.0, 0.5, 1.0]).view(3, 1).expand(3, 8)
    res["valid_after_errors"] = "ok" if torch.equal(out, want) else f"output {out[:, 0]}"
    # the same through FP8 dispatch: ones quantize exactly (scale 1/448, code 448)
    x8q, s8, _, _, _ = pf8.prepare(x8, w, idx, E, right_map, False, quants["fp8_block128"],
                                   False)
    out8 = torch.zeros(3, 256, dtype=torch.bfloat16)
    pf8.finalize(out8, dequantized(x8q, s8).to(torch.bfloat16), w, idx, False,
                 iface.delegate())
    want8 = want[:, :1].expand(3, 256).to(torch.bfloat16)
    res["valid_fp8_after_errors"] = "ok" if torch.equal(out8, want8) else f"output {out8[:, 0]}"
    return res


def catch(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        import traceback

        return [f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"]


def _scenario_cases(rank, cls, iface, quants, device):
    """Every scenario over the resident group and a gloo group, on ``device``'s tensors."""
    import torch.distributed as dist

    gloo = dist.new_group(backend="gloo")
    res = {}
    for name in SCENARIOS:
        for label, group in (("resident", None), ("gloo", gloo)):
            res[f"{name}-{label}"] = catch(_adapter_case, rank, cls, iface, quants, name,
                                           group, device)
    return res


def all_cases(rank, cls, iface, dbo, quants):
    return (_scenario_cases(rank, cls, iface, quants, "cpu"),
            _error_cases(rank, cls, iface, dbo, quants))


def standin_job(rank, ws):
    from resident_pg.ep_vllm import make_prepare_finalize_class

    iface, dbo = standin_interface()
    cls = make_prepare_finalize_class(iface)
    cases, errors = all_cases(rank, cls, iface, dbo, standin_quant_configs())
    return {"cases": cases, "errors": errors}


def standin_cuda_job(rank, ws):
    """The scenarios of standin_job on CUDA tensors (cuda_harness.DEVICE: the CPU in the dry
    run), every rank on cuda:0 of the GPU machine (under MPS)."""
    from resident_pg.ep_vllm import make_prepare_finalize_class

    C.setup_rank(rank, ws, timeout_s=60)
    iface, _ = standin_interface()
    cls = make_prepare_finalize_class(iface)
    return {"cases": _scenario_cases(rank, cls, iface, standin_quant_configs(), C.DEVICE)}


# ---------------------------------------------------------------- parent side


def case_problems(per_rank):
    return [f"rank {r}: {cid}: {p}" for r, v in enumerate(per_rank)
            for cid, ps in v["cases"].items() for p in ps]


def error_problems(per_rank, n):
    bad = [f"rank {r} {label}: {v}" for r, v in enumerate(per_rank)
           for label, v in v["errors"].items() if v != "ok"]
    if len(per_rank[0]["errors"]) != n:
        bad.append(f"{len(per_rank[0]['errors'])} error cases, expected {n}")
    return bad
