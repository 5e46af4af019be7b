"""Constants and small helpers of resident_pg.bench (parsing and formatting of sizes, ops and
backend specs, percentiles, logging), shared by its rank side, its parent side and its report,
and by resident_pg.bench.interference. Imports no other module of the bench and no torch."""

from __future__ import annotations

import math
import sys
from typing import Dict, List, Optional, Sequence, Set, Tuple

SCHEMA = "resident_pg.bench/1"

ALL_OPS = (
    "all_reduce",
    "all_to_all_single",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "send_recv",
)
OP_ALIASES = {
    "allreduce": "all_reduce",
    "all_to_all": "all_to_all_single",
    "alltoall": "all_to_all_single",
    "all_gather": "all_gather_into_tensor",
    "allgather": "all_gather_into_tensor",
    "reduce_scatter": "reduce_scatter_tensor",
    "reducescatter": "reduce_scatter_tensor",
    "sendrecv": "send_recv",
    "p2p": "send_recv",
}
DEFAULT_SIZES = "8,64,512,4K,16K,64K,256K,1M"
QUICK_SIZES = "8,512,16K,1M"
QUICK_SIZES_CUDA = "8,512,16K,64K,1M"
DEFAULT_BACKENDS = "resident,gloo"
# --device cuda: no baseline backend; the direct and the proxy path side by side.
DEFAULT_CUDA_BACKENDS = "resident:path=direct,resident:path=proxy"
DEFAULT_MODES = {"cpu": "eager", "cuda": "eager,graph"}
DEFAULT_WORLD_SIZES = "2,4,8"
QUICK_WORLD_SIZES = "2"

# Backends provided by a Python module that must be imported in the rank
# processes (importing it registers the backend with torch.distributed).
BACKEND_MODULES = {"resident": "resident_pg"}

# Project target: for 2 ranks, 8 B all_reduce, resident median <= gloo / 20.
TARGET = {"world_size": 2, "op": "all_reduce", "size": 8, "backend": "resident",
          "baseline": "gloo", "min_speedup": 20.0}

ELEM_BYTES = 4  # float32 everywhere


# --------------------------------------------------------------------------
# small helpers (also used by the tests)
# --------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "kib": 1024,
          "m": 1024 ** 2, "mb": 1024 ** 2, "mib": 1024 ** 2,
          "g": 1024 ** 3, "gb": 1024 ** 3, "gib": 1024 ** 3}


def parse_size(text: str) -> int:
    """'8' -> 8, '4K' / '4KiB' / '4kb' -> 4096, '1M' -> 1048576 (binary units)."""
    s = text.strip().lower().replace(" ", "")
    i = 0
    while i < len(s) and (s[i].isdigit() or s[i] == "."):
        i += 1
    num, unit = s[:i], s[i:]
    if not num or unit not in _UNITS:
        raise ValueError(f"bad size {text!r} (examples: 8, 512, 4K, 64KiB, 1M)")
    value = float(num) * _UNITS[unit]
    if value != int(value) or value < ELEM_BYTES:
        raise ValueError(f"size {text!r} must be a whole number of bytes >= {ELEM_BYTES}")
    return int(value)


def parse_sizes(text: str) -> List[int]:
    sizes = [parse_size(t) for t in text.split(",") if t.strip()]
    if not sizes:
        raise ValueError("no sizes given")
    return sizes


def fmt_size(n: int) -> str:
    for unit, div in (("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def parse_ops(text: str) -> List[str]:
    ops = []
    for t in text.split(","):
        t = t.strip().lower()
        if not t:
            continue
        if t == "all":
            ops.extend(o for o in ALL_OPS if o not in ops)
            continue
        t = OP_ALIASES.get(t, t)
        if t not in ALL_OPS:
            raise ValueError(f"unknown op {t!r}; choose from {', '.join(ALL_OPS)}")
        if t not in ops:
            ops.append(t)
    if not ops:
        raise ValueError("no ops given")
    return ops


def parse_int_list(text: str, what: str) -> List[int]:
    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"bad {what} list {text!r}") from None
    if not vals:
        raise ValueError(f"no {what} given")
    return vals


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method), q in [0, 100]."""
    v = sorted(values)
    if not v:
        return float("nan")
    pos = (len(v) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def parse_backend_spec(spec: str) -> Tuple[str, Dict[str, str], Dict[str, str]]:
    """'resident:path=proxy:RESIDENT_SPIN_US=10' -> ('resident', {'path': 'proxy'},
    {'RESIDENT_SPIN_US': '10'}): lower-case keys are pg_options of the group, upper-case
    keys environment variables of its rank processes."""
    name, *opts = [x.strip() for x in spec.strip().split(":")]
    if not name:
        raise ValueError(f"bad backend {spec!r} (expected NAME[:KEY=VALUE...])")
    pg_options: Dict[str, str] = {}
    env: Dict[str, str] = {}
    for o in opts:
        k, eq, v = o.partition("=")
        if not eq or not k.strip():
            raise ValueError(f"bad backend option {o!r} in {spec!r} (expected KEY=VALUE)")
        k = k.strip()
        (env if k.isupper() else pg_options)[k] = v.strip()
    return name, pg_options, env




def backend_labels(backends: Sequence[str]) -> List[str]:
    """Unique display labels; a backend given twice becomes 'gloo', 'gloo#2'."""
    seen: Dict[str, int] = {}
    labels = []
    for b in backends:
        seen[b] = seen.get(b, 0) + 1
        labels.append(b if seen[b] == 1 else f"{b}#{seen[b]}")
    return labels


def _median(v: Sequence[float]) -> float:
    return percentile(v, 50.0)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fmt_us(v: Optional[float]) -> str:
    if v is None:
        return "-"
    if v >= 1000:
        return f"{v:,.0f}"
    if v >= 100:
        return f"{v:.1f}"
    return f"{v:.2f}"


def latency_cells(r: Optional[dict], size: int, notes: Set[str],
                  spread: bool) -> Tuple[List[str], Optional[float]]:
    """One row's cells of a latency table at `size`: the median with its marks ('*': buffer
    rounded up, '!': the check failed; added to `notes`), then p10-p90 when `spread`. Returns
    (cells, median); a missing row gives '-' ('ERR' when it recorded an error) and None."""
    if r is None or "median_us" not in r:
        return ["ERR" if r is not None and "error" in r else "-"] + [""] * int(spread), None
    mark = ""
    if r.get("actual_bytes") != size:
        mark += "*"
        notes.add("*")
    if r.get("check") not in ("ok", "skipped"):
        mark += "!"
        notes.add("!")
    cells = [fmt_us(r["median_us"]) + mark]
    if spread:
        cells.append(f"{fmt_us(r['p10_us'])}-{fmt_us(r['p90_us'])}")
    return cells, r["median_us"]


class TorchBuffers:
    """float32 buffers of the bench's devices: `self.torch` (the module) and `self.device`."""

    def alloc(self, numel: int, fill: Optional[float] = 0.0):
        t = self.torch
        if fill is None:
            return t.empty(numel, dtype=t.float32, device=self.device)
        return t.full((numel,), float(fill), dtype=t.float32, device=self.device)

    def arange(self, numel: int, start: float = 0.0):
        t = self.torch
        return t.arange(numel, dtype=t.float32, device=self.device) + start


class GroupRecord:
    """What one group (world size, backend variant, mode, round) measured, as report.aggregate
    reads it; ladder.GroupRun (spawned ranks) and launched.LaunchedGroupRun (a launcher's
    ranks) fill it from the ranks' messages (rank.run_ladder's `post`)."""

    def __init__(self, ws, backend, label, cells, cfg, args):
        self.ws, self.backend, self.label = ws, backend, label
        self.cells = cells        # [(cid, op, size)]
        self.cfg, self.args = cfg, args
        self.results: Dict[int, Dict[int, dict]] = {}  # cid -> rank -> result
        self.cell_errors: Dict[int, Dict[int, str]] = {}
        self.errors: List[dict] = []   # group-level problems
        self.launches: List[dict] = []
        self.rank_info: Dict[int, dict] = {}  # rank -> _rank_info() of its latest launch
        self.skip_reason: Optional[str] = None  # set when the group was never launched

    def skip(self, reason: Optional[str]) -> Optional[str]:
        """Marks the group not run, for `reason` (None: it runs); returns the reason."""
        if reason:
            self.skip_reason = reason
            self.errors.append({"attempt": -1, "status": "time_limit", "error": reason})
        return reason

    def take(self, rank: int, msg) -> None:
        """Records what a rank's message carries of the results (the other kinds say where the
        ladder is; each runner follows those itself)."""
        kind = msg[0]
        if kind == "ready" and len(msg) > 3:
            self.rank_info[rank] = msg[3]
        elif kind == "result":
            self.results.setdefault(msg[2], {})[rank] = msg[3]
        elif kind == "cell_error":
            self.cell_errors.setdefault(msg[2], {})[rank] = msg[3]
