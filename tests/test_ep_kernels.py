"""resident_pg.ep_kernels and the EP kernels' entry points in resident_pg._C, without a GPU: the
dtype codes agree with kernels/ep_args.hpp, the kernels are offered only for CUDA devices, and
bad arguments raise ValueError before anything is launched.  The kernels themselves run in the
GPU suites (tests/test_moe.py, tests/test_ep.py and tests/test_ep_fp8.py, ``-m gpu``)."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from resident_pg import ep_kernels

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_dtype_codes_match_the_kernels():
    text = (ROOT / "kernels" / "ep_args.hpp").read_text()
    enum = re.search(r"enum class Dtype : int32_t \{([^}]*)\}", text).group(1)
    codes = {name: int(v) for name, v in re.findall(r"k(\w+) = (\d+)", enum)}
    names = {torch.float32: "Float32", torch.float16: "Float16", torch.bfloat16: "BFloat16"}
    assert {names[dt]: code for dt, code in ep_kernels.REDUCE_DTYPES.items()} == codes


def test_kernels_are_offered_for_cuda_devices_only():
    assert ep_kernels.available(torch.device("cpu")) is False


def _unpack(row_bytes, head_bytes, tail_out):
    from resident_pg import _C

    # addresses of zero: the call must fail on its arguments before any launch
    _C.ep_unpack(0, 2, 2, 4, 8, 0, 0, row_bytes, head_bytes, tail_out, 0, 0, 0, 0)


@pytest.mark.parametrize("row_bytes,head_bytes,tail_out", [
    (24, 6, 1),     # a split whose head is not whole 4-byte words
    (26, 16, 1),    # nor its tail
    (24, 16, 0),    # a head shorter than the row without a tail to take the rest
    (24, 24, 1),    # a tail with nothing to take
    (24, 32, 0),    # a head longer than the row
    (24, 0, 0),     # no head
])
def test_unpack_refuses_bad_row_splits(row_bytes, head_bytes, tail_out):
    with pytest.raises(ValueError, match="head_bytes"):
        _unpack(row_bytes, head_bytes, tail_out)


@pytest.mark.parametrize("in_code,out_code", [(3, 0), (0, -1)])
def test_combine_reduce_refuses_unknown_dtype_codes(in_code, out_code):
    from resident_pg import _C

    with pytest.raises(ValueError, match="dtype code"):
        _C.ep_combine_reduce(0, 0, 0, 0, 1, 1, 8, 2, in_code, out_code, 0)


def test_combine_pack_refuses_sources_without_counts():
    from resident_pg import _C

    with pytest.raises(ValueError, match="per_source"):
        _C.ep_combine_pack(0, 2, 0, 4, 0, 0, 0, 16, 0)


@pytest.mark.parametrize("cast,hidden,row_bytes,match", [
    (3, 128, 132, "route cast 3"),          # no such cast
    (1, 100, 104, "multiple of 128"),       # a group of channels cut short
    (1, 256, 258, "rows of 264 bytes"),     # float32 scales: 4 bytes per group
    (2, 256, 258, "multiple of 512"),       # UE8M0: scales read as int32s of 4 groups
    (2, 512, 528, "rows of 516 bytes"),     # UE8M0: 1 byte per group
])
def test_route_refuses_bad_fp8_rows(cast, hidden, row_bytes, match):
    from resident_pg import _C

    # addresses of zero: the call must fail on its arguments before any launch
    with pytest.raises(ValueError, match=match):
        _C.ep_route(0, 8, 1, 1, 2, 2, 1, 0, hidden * 2, 0, row_bytes, 0, 0, 0, 0,
                    cast=cast, x_dtype=2, round_scale=True, hidden=hidden)
