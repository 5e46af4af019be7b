"""The FP8 cast of resident_pg.ep in one process, bitwise against the numpy cast of
ep_reference.py (an fp8 e4m3fn encoder written from the format's definition).

The encoder itself against torch's float8_e4m3fn on every finite code and on rounding; then
resident_pg.ep_fp8.quantize / dequantize / ue8m0_bytes, Fp8Rows of a rank without tokens, and
(``gpu`` marker) the routing kernel's FP8 cast (ep_kernels.route with ``fp8``).  FP8 dispatch
and combine over ranks: test_ep.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import dist_harness as H
from ep_reference import fp8_codes, fp8_quantize, fp8_tokens, fp8_values, ue8m0_packed


def test_fp8_reference_encoder_covers_every_code():
    """The test's numpy fp8 encoder / decoder agree with torch's float8_e4m3fn on every finite
    code, and on rounding random float32 values (ties included)."""
    import torch

    codes = np.arange(256, dtype=np.uint8)
    finite = (codes & 0x7F) != 0x7F
    vals = torch.from_numpy(codes).view(torch.float8_e4m3fn).double().numpy()
    assert np.array_equal(fp8_values(codes[finite]), vals[finite])
    assert np.array_equal(fp8_codes(vals[finite].astype(np.float32)), codes[finite])
    rng = np.random.default_rng(7)
    y = (rng.standard_normal(50000) * 2.0 ** rng.uniform(-14, 9, 50000)).astype(np.float32)
    y = np.concatenate([np.clip(y, -448, 448),
                        ((vals[finite][1:] + vals[finite][:-1]) / 2).astype(np.float32)])
    y = y[np.abs(y) <= 448]
    want = torch.from_numpy(y).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(fp8_codes(y), want)


@pytest.mark.parametrize("round_scale", (False, True))
@pytest.mark.parametrize("dt", ("bfloat16", "float16", "float32"))
def test_fp8_quantize_matches_reference(dt, round_scale):
    """resident_pg.ep_fp8.quantize against the numpy cast, bitwise; UE8M0 bytes of rounded
    scales are their exponents; dequantize inverts within fp8 rounding."""
    import torch

    from resident_pg.ep_fp8 import dequantize, quantize, ue8m0_bytes

    x = fp8_tokens(f"quant/{dt}", 0, 40, 512, dt)  # float16: the smallest groups are subnormal
    q, s = quantize(torch.from_numpy(x).to(H.tdtype(dt)), round_scale)
    codes, scales = fp8_quantize(x, round_scale)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert np.array_equal(q.view(torch.uint8).numpy(), codes)
    assert np.array_equal(s.numpy().view(np.uint32), scales.view(np.uint32))
    if round_scale:
        assert np.array_equal(ue8m0_bytes(s).numpy(), (scales.view(np.uint32) >> 23) & 0xFF)
        packed = torch.from_numpy(ue8m0_packed(scales).view(np.int32))
        assert torch.equal(dequantize(q, packed), dequantize(q, s))
    deq = dequantize(q, s).double().numpy()
    s_full = np.repeat(scales.astype(np.float64), 128, axis=1)
    assert (np.abs(deq - x) <= np.abs(x) * 2.0 ** -4 * (1 + 2.0 ** -20) + s_full * 2.0 ** -10).all()


@pytest.mark.parametrize("hidden,use_ue8m0", [(128, False), (512, False), (512, True)])
def test_fp8_rows_of_a_rank_without_tokens(hidden, use_ue8m0):
    """A rank with no tokens packs no rows, whatever the number of scale groups (one group per
    row gives an empty scale tensor that torch cannot view as bytes)."""
    import torch

    from resident_pg.ep_fp8 import Fp8Rows, row_bytes

    rows = Fp8Rows(hidden, 4, 2, 8, use_ue8m0, "cpu").pack(
        torch.zeros(0, hidden, dtype=torch.bfloat16), round_scale=use_ue8m0)
    assert rows.dtype == torch.uint8 and tuple(rows.shape) == (0, row_bytes(hidden, use_ue8m0))


@pytest.mark.gpu
@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("dt", ("bfloat16", "float16", "float32"))
def test_fp8_route_cast_matches_reference(dt, round_scale, use_ue8m0):
    """The routing kernel's FP8 cast (ep_kernels.route with ``fp8``): every placed (token,
    expert) row holds the token's fp8 codes and scales of the numpy cast, bitwise; one process,
    2 peers' worth of slots (rows go to both halves of the send buffer)."""
    import torch

    from resident_pg import ep_kernels
    from resident_pg.ep_fp8 import row_bytes

    T, K, E, W, Hd = 24, 3, 8, 2, 1024
    x = fp8_tokens(f"route/{dt}", 0, T, Hd, dt)  # float16: the smallest groups are subnormal
    codes, scales = fp8_quantize(x, round_scale)
    rng = np.random.default_rng(11)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int64)
    idx[3] = -1                                   # a token routed nowhere
    C, RB = T * K, row_bytes(Hd, use_ue8m0)
    dev = torch.device("cuda", 0)
    send_x = torch.zeros(W * C + 1, RB, dtype=torch.uint8, device=dev)
    send_counts = torch.empty(W, E // W, dtype=torch.int64, device=dev)
    pair_slot = torch.empty(T * K, dtype=torch.int64, device=dev)
    dropped = torch.empty((), dtype=torch.int64, device=dev)
    with torch.cuda.device(dev):
        ep_kernels.route(torch.from_numpy(idx).to(dev),
                         torch.from_numpy(x).to(H.tdtype(dt)).to(dev),
                         send_x, send_counts, pair_slot, dropped, E, W, C,
                         torch.cuda.current_stream(dev).cuda_stream, (round_scale, use_ue8m0))
        torch.cuda.synchronize(dev)
    rows, slots = send_x.cpu().numpy(), pair_slot.cpu().numpy()
    tail = ((scales.view(np.uint32) >> 23) & 0xFF).astype(np.uint8) if use_ue8m0 \
        else scales.view(np.uint8).reshape(T, -1)
    placed = 0
    for p in range(T * K):
        t = p // K
        if idx[t, p % K] < 0:
            assert slots[p] == W * C
            continue
        placed += 1
        assert np.array_equal(rows[slots[p], :Hd], codes[t]), f"fp8 codes of pair {p}"
        assert np.array_equal(rows[slots[p], Hd:], tail[t]), f"scales of pair {p}"
    assert placed == (T - 1) * K and int(dropped) == 0
