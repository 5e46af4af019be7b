"""resident_pg.ep_kernels and the EP kernels' entry points in resident_pg._C, without a GPU: the
dtype codes agree with kernels/ep_args.hpp, the kernels are offered only for CUDA devices, and
bad arguments raise ValueError before anything is launched.  The kernels themselves run in the
GPU suites (tests/test_moe.py and tests/test_ep.py, ``-m gpu``)."""

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


def _route_phase(row_bytes, x=0, send_x=0, ranks=2, cast=0):
    from resident_pg import _C

    return _C.ep_route_phase(0, 8, 1, 1, 2, ranks, 1, x, row_bytes, send_x, row_bytes, 0, 0, 0,
                             cast=cast, x_dtype=2, round_scale=True, hidden=128)


def test_steps_run_in_the_exchange_only_where_they_fit():
    """A step for the exchange's kernel is made where its copy unit is at least 4 bytes, its
    ranks and top-k fit the kernel's static shared memory, and a reduction keeps its dtype;
    elsewhere None, and the caller launches the step's own kernel."""
    from resident_pg import _C

    assert isinstance(_route_phase(64), _C.EpPhase)
    assert isinstance(_route_phase(12), _C.EpPhase)           # 4-byte units
    assert _route_phase(6) is None                            # 2-byte units
    assert _route_phase(64, x=2) is None                      # an address of 2-byte alignment
    assert _route_phase(64, ranks=65) is None                 # past the static shared memory
    assert isinstance(_route_phase(132, cast=1), _C.EpPhase)  # an FP8 cast stores its own units
    assert isinstance(_C.ep_unpack_phase(0, 2, 2, 4, 8, 0, 0, 32, 32, 0, 0, 0, 0), _C.EpPhase)
    assert _C.ep_unpack_phase(0, 2, 2, 4, 8, 0, 0, 6, 6, 0, 0, 0, 0) is None
    assert isinstance(_C.ep_combine_pack_phase(0, 2, 2, 4, 0, 0, 0, 16), _C.EpPhase)
    assert isinstance(_C.ep_combine_reduce_phase(0, 0, 0, 0, 1, 8, 16, 2, 2, 2), _C.EpPhase)
    assert _C.ep_combine_reduce_phase(0, 0, 0, 0, 1, 8, 16, 2, 2, 0) is None   # bf16 -> f32
    assert _C.ep_combine_reduce_phase(0, 0, 0, 0, 1, 33, 16, 2, 2, 2) is None  # top-33
    with pytest.raises(ValueError, match="head_bytes"):
        _C.ep_unpack_phase(0, 2, 2, 4, 8, 0, 0, 24, 6, 1, 0, 0, 0)


def test_kernel_limits_match_the_bindings():
    """The steps' static shared memory (kernels/ep_args.hpp) holds what the bindings let in."""
    text = (ROOT / "kernels" / "ep_args.hpp").read_text()
    assert int(re.search(r"kPhaseMaxRanks = (\d+)", text).group(1)) == 64
    assert int(re.search(r"kPhaseMaxTopk = (\d+)", text).group(1)) == 32
    exchange = (ROOT / "kernels" / "exchange_args.hpp").read_text()
    assert int(re.search(r"kMaxRanks = (\d+)", exchange).group(1)) <= 64
