"""The option registry (csrc/core/options.def): the extension's copy and the text's agree, the
docs' table is the registry's, the core parses, describes and refuses what the registry says."""

import os
import random
import subprocess
import sys

import pytest

import dist_harness as H
from resident_pg import options

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE_START = "<!-- options table: python -m resident_pg.options --markdown -->\n"
TABLE_END = "<!-- end of options table -->\n"


def test_extension_and_def_file_agree():
    from resident_pg import _C

    assert [dict(o) for o in _C.options()] == options.from_def_file()
    assert options.OPTIONS == options.from_def_file()


def test_registry_is_well_formed():
    keys = [o["key"] for o in options.OPTIONS]
    assert len(keys) == len(set(keys))
    user = [o for o in options.LIVE if o["tier"] == "user"]
    assert 1 <= len(user) <= 12, [o["variable"] for o in user]
    for o in options.LIVE:
        assert o["tier"] in options.TIERS and o["doc"] and "\n" not in o["doc"], o
        if o["kind"] == "choice":
            assert o["default"] in o["choices"].split("|"), o
        if o["kind"] in ("unsigned", "int"):
            assert o["min"] <= int(o["default"]) <= o["max"], o
    for o in options.REMOVED:
        assert "docs/decisions.md" in o["doc"], o


def test_tuning_doc_table_is_generated_from_the_registry():
    """docs/tuning.md's table between its markers is `python -m resident_pg.options --markdown`:
    every registered option is documented with its default and tier, every documented one is
    registered."""
    doc = open(os.path.join(ROOT, "docs", "tuning.md"), encoding="utf-8").read()
    assert TABLE_START in doc and TABLE_END in doc
    table = doc.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0]
    out = subprocess.run([sys.executable, "-m", "resident_pg.options", "--markdown"], cwd=ROOT,
                         capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=ROOT)).stdout
    assert table == out, "regenerate it: python -m resident_pg.options --markdown"
    rows = [r.split(" | ") for r in table.splitlines() if r.startswith("| `RESIDENT_")]
    assert [(r[0].strip("|` "), r[1], r[2]) for r in rows] == \
        [(o["variable"], options.default_text(o), o["tier"])
         for t in options.TIERS for o in options.LIVE if o["tier"] == t]


def test_vllm_plugin_reads_the_registered_variables():
    from resident_pg import vllm_plugin as v

    for var, default in ((v.ENABLE_VAR, "0"), (v.MAX_BYTES_VAR, str(v.DEFAULT_MAX_BYTES)),
                         (v.TIMEOUT_VAR, str(v.DEFAULT_TIMEOUT_S))):
        o = options.BY_VARIABLE[var]
        assert o["default"] == default and o["reader"] == "resident_pg/vllm_plugin.py", o


def test_closest_names_a_near_option():
    assert options.closest("RESIDENT_SLOT_BYTE") == "RESIDENT_SLOT_BYTES"
    assert options.closest("gpu_protcol") == "RESIDENT_GPU_PROTOCOL"
    assert options.closest("RESIDENT_VLLM_MAX_BYTE", pg_only=True) != "RESIDENT_VLLM_MAX_BYTES"
    assert options.closest("RESIDENT_ZZZZZZZZZZZZZZZZZZZZ") is None


def test_check_value():
    o = options.BY_VARIABLE
    assert options.check_value(o["RESIDENT_PATH"], "proxy") is None
    assert "not one of" in options.check_value(o["RESIDENT_PATH"], "verbs")
    assert options.check_value(o["RESIDENT_SLOTS"], "1024") is None
    assert "[2, 1024]" in options.check_value(o["RESIDENT_SLOTS"], "1025")
    assert "integer" in options.check_value(o["RESIDENT_PROXY_CPU"], "x")


def _config_job(rank, ws, settings):
    """Creates a group of one per pg_options dict; its config() or the error."""
    import torch
    import torch.distributed as dist

    out = []
    for opts in settings:
        try:
            g = dist.new_group([0], backend="resident", pg_options=opts)
            out.append(g._get_backend(torch.device("cpu")).config())
        except Exception as e:  # noqa: BLE001
            out.append(f"{type(e).__name__}: {e}")
    return out


def _config_options():
    return [o for o in options.LIVE if o["reader"] == "Config"]


def _bad_value(o):
    if o["kind"] == "choice":
        return "x" + o["choices"].split("|")[0]
    if o["kind"] in ("unsigned", "int"):
        return str(o["max"] + 1)
    return None


@pytest.mark.resident_only
def test_core_parses_describes_and_refuses_as_registered():
    """A group created with no options describes every registered default; a random valid value
    per option is described back; an out-of-range or unknown choice fails naming the option; a
    removed option fails naming its variable and why; an unknown key names the closest one."""
    rng = random.Random(35)
    cfg = _config_options()
    valid = {}
    for o in cfg:
        if o["kind"] == "choice":
            valid[o["key"]] = rng.choice(o["choices"].split("|"))
        elif o["kind"] in ("unsigned", "int"):
            hi = min(o["max"], o["min"] + 4096)  # small: a group allocates its rings
            v = rng.randint(o["min"], hi)
            step = {"slot_bytes": 64, "gpu_chunk_bytes": 2048}.get(o["key"], 1)
            valid[o["key"]] = str(max(o["min"], v - v % step))
    valid["proxy_cpu"] = str(rng.choice(sorted(os.sched_getaffinity(0))))  # must be allowed
    valid.pop("transport", None)
    valid.pop("path", None)  # a group of one may not require direct stores to itself
    settings = [None, valid]
    settings += [{o["key"]: _bad_value(o)} for o in cfg if _bad_value(o) is not None]
    settings += [{o["key"]: "0"} for o in options.REMOVED]
    settings += [{"slot_byte": "64"}]
    got = H.run_ranks(_config_job, 1, args=(settings,), timeout_s=120)[0]
    defaults, described = got[0], got[1]
    # A group describes what it resolved: the automatic chunk (0) of a one-host group is 64 KiB.
    resolved = {("gpu_chunk_bytes", "0"): "65536"}
    for o in cfg:
        if o["default"]:
            v = resolved.get((o["key"], o["default"]), o["default"])
            assert f"{o['key']}={v}" in defaults.split(), (o, defaults)
    for k, v in valid.items():
        v = resolved.get((k, v), v)
        assert f"{k}={v}" in described.split(), (k, v, described)
    bad = [o for o in cfg if _bad_value(o) is not None]
    for o, text in zip(bad, got[2:2 + len(bad)]):
        assert text.startswith("ValueError: "), (o, text)
        assert o["key"] in text or o["variable"] in text, (o, text)
    removed = got[2 + len(bad):2 + len(bad) + len(options.REMOVED)]
    for o, text in zip(options.REMOVED, removed):
        assert text.startswith("ValueError: ") and f"({o['variable']}) is not supported" in text
        assert "docs/decisions.md" in text, text
    assert got[-1].startswith("ValueError: ") and "did you mean 'slot_bytes'" in got[-1], got[-1]


@pytest.mark.resident_only
@pytest.mark.parametrize("var", ["RESIDENT_GPU_PREFETCH", "RESIDENT_GPU_PROXY_SIMPLE_ABOVE"])
def test_removed_switch_variables_fail_group_creation(var):
    """A switch that measurement settled is refused from the environment too, so that a script
    that sets it does not silently measure the default."""
    out = H.run_ranks(H.init_outcome_job, 1, env={var: "0"}, init=False, timeout_s=60)[0]
    assert out.startswith("ValueError: ") and f"{var} is not supported" in out, out
    assert "removed" in out and "docs/decisions.md" in out, out
