"""Reference computations shared by the EP tests (test_ep.py, test_ep_vllm.py), in float64:
rounding to a payload dtype, and the output of a combine of scaled stand-in experts."""

from __future__ import annotations

import numpy as np

import dist_harness as H


def to_dtype(a, dtype_name):
    """float64 values -> the payload dtype's values, back as float64 (torch does the rounding)."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64)).to(
        H.tdtype(dtype_name)).double().numpy()


def combine_reference(x, idx, w, dtype_name, scale_of):
    """``y[t] = sum_k w[t, k] * round(x[t] * scale_of(idx[t, k]))`` over the routed pairs
    (``idx >= 0``; each expert's output rounded to the payload dtype, as the stand-in experts
    give it), and a per-element tolerance for the combine's float32 sum in another order."""
    y = np.zeros(x.shape)
    mag = np.zeros(x.shape)
    for t in range(len(x)):
        for k in range(idx.shape[1]):
            e = idx[t, k]
            if e >= 0:
                out = to_dtype(x[t] * scale_of(e), dtype_name)
                y[t] += w[t, k] * out
                mag[t] += np.abs(w[t, k] * out)
    ulp = 2.0 ** -8 if dtype_name == "bfloat16" else 2.0 ** -23
    return y, np.abs(y) * ulp + mag * 2.0 ** -20 + 1e-7
