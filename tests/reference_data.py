"""Deterministic test data and independent references (numpy, float64) for the test modules.

Any process can regenerate any rank's input from its key (:func:`make_input`), so every rank
checks its results against a reference it computes itself, never against another rank's output;
reductions are compared within the dtype's rounding (:func:`compare_reduction`), everything else
bitwise (:func:`compare_exact`). dist_harness re-exports these names.
"""

from __future__ import annotations

import hashlib
import zlib


def seed_of(*parts) -> int:
    return zlib.crc32("/".join(str(p) for p in parts).encode())


def rng_for(key: str, rank: int):
    import numpy as np

    return np.random.default_rng([seed_of(key), rank])


def count_parts(rng, rows, k: int):
    """Each entry of ``rows`` as ``k`` counts that add up to it, one of them negative (-1..-3,
    which counts as 0) when k > 2: the [W, k] form of all_to_all_device_splits' counts, as an
    int64 numpy array [len(rows), k]."""
    import numpy as np

    out = np.zeros((len(rows), k), dtype=np.int64)
    for p, v in enumerate(rows):
        cuts = np.sort(rng.integers(0, int(v) + 1, size=k - 1))
        out[p] = np.diff(np.concatenate(([0], cuts, [int(v)])))
        if k > 2:
            j = int(rng.integers(0, k))
            out[p, (j + 1) % k] += out[p, j]
            out[p, j] = -int(rng.integers(1, 4))
    return out


FLOAT_DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16")
INT_DTYPE_NAMES = ("int32", "int64", "uint8", "int8")
# reduced through a mapping of the backend's (bool: a logical or / and / xor; complex: the real
# and imaginary parts as floats, SUM and AVG only)
BOOL_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
COMPLEX_DTYPE_NAMES = ("complex64", "complex128")


def tdtype(name: str):
    import torch

    return getattr(torch, name)


def is_float_name(name: str) -> bool:
    return name in FLOAT_DTYPE_NAMES


def itemsize(name: str) -> int:
    return {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2,
            "int32": 4, "int64": 8, "uint8": 1, "int8": 1, "bool": 1,
            "complex64": 8, "complex128": 16}[name]


def _complex_part(name: str) -> str:
    return "float32" if name == "complex64" else "float64"


def make_input(key: str, rank: int, n: int, dtype_name: str, kind: str = "normal"):
    """Deterministic random tensor for (key, rank): any rank can regenerate any other's.

    kinds: "normal" (floats ~ N(0, 3), no exact zeros; ints over the full range,
    so SUM/PRODUCT wrap), "near1" (floats in [0.6, 1.4]; ints in [-3, 3]
    ([0, 3] for uint8)), "avg" (ints whose int64 sum cannot overflow). bool: 0 or 1 at
    random; complex: (real, imaginary) pairs drawn as the float type's, of the same kind.
    """
    import numpy as np
    import torch

    rng = rng_for(key, rank)
    if dtype_name == "bool":
        return torch.from_numpy(rng.integers(0, 2, size=n).astype(np.bool_)).contiguous()
    if dtype_name in COMPLEX_DTYPE_NAMES:  # (real, imaginary) pairs drawn as the float type's
        parts = make_input(key, rank, 2 * n, _complex_part(dtype_name), kind)
        return torch.view_as_complex(parts.reshape(n, 2)).contiguous()
    if is_float_name(dtype_name):
        if kind == "near1":
            a = rng.uniform(0.6, 1.4, n)
        else:
            a = rng.standard_normal(n) * 3.0
            a[a == 0] = 0.5
        t = torch.from_numpy(a).to(tdtype(dtype_name))
        if kind != "near1":
            # rounding to a short float can give exact zeros; avoid -0/+0 ambiguity
            t[t == 0] = 0.25
        return t.contiguous()
    np_dt = np.dtype(dtype_name)
    info = np.iinfo(np_dt)
    if kind == "near1":
        lo, hi = (0, 3) if dtype_name == "uint8" else (-3, 3)
    elif kind == "avg" and dtype_name == "int64":
        lo, hi = -(1 << 60), (1 << 60)
    else:
        lo, hi = int(info.min), int(info.max)
    a = rng.integers(lo, hi, size=n, endpoint=True, dtype=np.int64 if dtype_name != "uint8" else np.uint8)
    return torch.from_numpy(a.astype(np_dt)).contiguous()


def to_np(t):
    """Tensor -> numpy; bfloat16 becomes float32 (exact)."""
    import torch

    if t.dtype == torch.bfloat16:
        return t.to(torch.float32).numpy()
    return t.numpy()


def bits(t):
    """Tensor -> numpy integer view of its bits (for bitwise comparisons)."""
    import torch

    view = {torch.float32: torch.int32, torch.float64: torch.int64,
            torch.float16: torch.int16, torch.bfloat16: torch.int16}
    if t.dtype in view:
        return t.contiguous().view(view[t.dtype]).numpy()
    return t.contiguous().numpy()


def digest(t) -> str:
    return hashlib.sha256(bits(t).tobytes()).hexdigest()[:16] + f"/{t.dtype}/{tuple(t.shape)}"


# numpy's elementwise function per reduction op (AVG: the sum, divided afterwards).
_FOLD = {"SUM": "add", "AVG": "add", "PRODUCT": "multiply", "MIN": "minimum", "MAX": "maximum",
         "BAND": "bitwise_and", "BOR": "bitwise_or", "BXOR": "bitwise_xor"}
_FLOAT_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX")


def _fold(xs, op, dt):
    """xs[0] op xs[1] op ... in rank order, in dtype dt (integers wrap)."""
    import numpy as np

    fn = getattr(np, _FOLD[op])
    acc = xs[0].copy()
    with np.errstate(over="ignore"):
        for x in xs[1:]:
            acc = fn(acc, x, dtype=dt)
    return acc


def reference_reduce(inputs: list, op: str, dtype_name: str):
    """Independent reference of a reduction of `inputs` (tensors, rank order 0..N-1).

    Semantics: float32/float64 accumulate in that dtype; float16/bfloat16 in float32,
    rounded once at the end; AVG divides the sum by N at the end (ints: int64 sum,
    truncation toward zero, then cast); integer SUM/PRODUCT wrap.
    Returns a torch tensor of dtype_name.
    """
    import numpy as np
    import torch

    n = len(inputs)
    op = op.upper()
    if dtype_name == "bool":
        fold = {"SUM": np.logical_or, "MAX": np.logical_or, "BOR": np.logical_or,
                "PRODUCT": np.logical_and, "MIN": np.logical_and, "BAND": np.logical_and,
                "BXOR": np.logical_xor}[op]
        acc = inputs[0].numpy().astype(np.bool_)
        for t in inputs[1:]:
            acc = fold(acc, t.numpy().astype(np.bool_))
        return torch.from_numpy(np.ascontiguousarray(acc))
    if dtype_name in COMPLEX_DTYPE_NAMES:
        if op not in ("SUM", "AVG"):
            raise ValueError(op)
        part = _complex_part(dtype_name)
        re = reference_reduce([t.real.contiguous() for t in inputs], op, part)
        im = reference_reduce([t.imag.contiguous() for t in inputs], op, part)
        return torch.complex(re, im)
    if is_float_name(dtype_name):
        acc_dt = np.float64 if dtype_name == "float64" else np.float32
        xs = [to_np(t).astype(acc_dt) for t in inputs]
        if op not in _FLOAT_OPS:
            raise ValueError(op)
        acc = _fold(xs, op, acc_dt)
        if op == "AVG":
            acc = (acc / acc_dt(n)).astype(acc_dt)
        return torch.from_numpy(np.ascontiguousarray(acc)).to(tdtype(dtype_name))
    np_dt = np.dtype(dtype_name)
    xs = [t.numpy().astype(np_dt) for t in inputs]
    if op == "AVG":
        s = np.zeros(xs[0].shape, dtype=np.int64)
        for x in xs:
            s = s + x.astype(np.int64)
        q = np.sign(s) * (np.abs(s) // n)  # truncation toward zero
        return torch.from_numpy(q.astype(np_dt))
    if op not in _FOLD:
        raise ValueError(op)
    return torch.from_numpy(np.ascontiguousarray(_fold(xs, op, np_dt)))


def _ulp(ref, dtype_name: str):
    import numpy as np

    a = np.abs(to_np(ref).astype(np.float64))
    if dtype_name == "float16":
        return np.spacing(np.abs(ref.numpy())).astype(np.float64)
    if dtype_name == "bfloat16":
        a = np.maximum(a, 2.0 ** -126)
        return np.exp2(np.floor(np.log2(a)) - 7)
    if dtype_name == "float32":
        return np.spacing(np.abs(ref.numpy())).astype(np.float64)
    return np.spacing(np.abs(ref.numpy()))


def compare_reduction(got, ref, inputs: list, op: str, dtype_name: str, label: str) -> list:
    """Return a list of error strings (empty when got matches the reference).

    Integers and MIN/MAX must match bitwise.  Float SUM/AVG/PRODUCT: float32 /
    float64 within a few ulps of the accumulated magnitude; float16 / bfloat16
    within 1 ulp of the correctly rounded reference (accumulated in float32).
    """
    import numpy as np

    errs = []
    if got.dtype != ref.dtype or tuple(got.shape) != tuple(ref.shape):
        return [f"{label}: got {got.dtype}{tuple(got.shape)}, expected {ref.dtype}{tuple(ref.shape)}"]
    op = op.upper()
    if dtype_name in COMPLEX_DTYPE_NAMES:  # each part as its float type
        part = _complex_part(dtype_name)
        for name, get in (("real", lambda t: t.real), ("imag", lambda t: t.imag)):
            errs += compare_reduction(get(got).contiguous(), get(ref).contiguous(),
                                      [get(t).contiguous() for t in inputs], op, part,
                                      f"{label} ({name})")
        return errs
    if not is_float_name(dtype_name) or op in ("MIN", "MAX"):
        gb, rb = bits(got), bits(ref)
        bad = np.nonzero(gb != rb)[0]
        if bad.size:
            i = int(bad[0])
            errs.append(
                f"{label}: {bad.size}/{gb.size} elements differ bitwise; first at [{i}]: "
                f"got {got[i].item()!r}, expected {ref[i].item()!r}"
            )
        return errs
    g = to_np(got).astype(np.float64)
    r = to_np(ref).astype(np.float64)
    if not np.all(np.isfinite(g)):
        i = int(np.nonzero(~np.isfinite(g))[0][0])
        return [f"{label}: non-finite result at [{i}]: {g[i]!r} (expected {r[i]!r})"]
    n = len(inputs)
    if dtype_name in ("float16", "bfloat16"):
        tol = _ulp(ref, dtype_name) * 1.0 + 1e-30
    else:
        eps = float(np.finfo(np.float32 if dtype_name == "float32" else np.float64).eps)
        if op == "PRODUCT":
            mag = np.abs(r)
        else:
            mag = np.sum([np.abs(to_np(t).astype(np.float64)) for t in inputs], axis=0)
            if op == "AVG":
                mag = mag / n
        tol = 2.0 * n * eps * mag + _ulp(ref, dtype_name)
    diff = np.abs(g - r)
    bad = np.nonzero(diff > tol)[0]
    if bad.size:
        i = int(bad[np.argmax(diff[bad] / np.maximum(tol[bad], 1e-300))])
        errs.append(
            f"{label}: {bad.size}/{g.size} elements out of tolerance; worst at [{i}]: "
            f"got {g[i]!r}, expected {r[i]!r}, |diff| {diff[i]:.3g} > tol {tol[i]:.3g}"
        )
    return errs


def compare_exact(got, ref, label: str) -> list:
    import numpy as np

    if got.dtype != ref.dtype or tuple(got.shape) != tuple(ref.shape):
        return [f"{label}: got {got.dtype}{tuple(got.shape)}, expected {ref.dtype}{tuple(ref.shape)}"]
    gb, rb = bits(got), bits(ref)
    bad = np.nonzero(gb.reshape(-1) != rb.reshape(-1))[0]
    if bad.size:
        i = int(bad[0])
        return [f"{label}: {bad.size}/{gb.size} elements differ; first at flat [{i}]: "
                f"got {got.reshape(-1)[i].item()!r}, expected {ref.reshape(-1)[i].item()!r}"]
    return []
