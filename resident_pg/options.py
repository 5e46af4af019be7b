"""The option registry: every ``RESIDENT_*`` option, as declared in csrc/core/options.def.

``OPTIONS`` holds a dict per option (key, variable, kind, tier, default, min, max, choices, doc,
reader, pg_option), the removed ones last (tier ``removed``, doc: why they are refused). It comes
from the extension (``resident_pg._C.options()``) when that loads, else from options.def's text,
so that the doctor works before a build. ``python -m resident_pg.options --markdown`` prints
docs/tuning.md's option table; tests/test_options.py checks that the two sources and the doc
agree.
"""

import argparse
import difflib
import os
import re
import sys

DEF_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "csrc", "core", "options.def")
TIERS = ("user", "advanced", "developer")
_KINDS = {"kUnsigned": "unsigned", "kInt": "int", "kChoice": "choice", "kString": "string"}
_TIERS = {"kUser": "user", "kAdvanced": "advanced", "kDeveloper": "developer"}
_TOKEN = re.compile(r'\s*("(?:[^"\\]|\\.)*"|[^,]+?)\s*(?:,|$)')


def _literal(token):
    if token.startswith('"'):
        return token[1:-1].encode().decode("unicode_escape").encode("latin-1").decode()
    return token


def _number(token):
    return int(token.rstrip("uUlL"))


def parse_def(text):
    """The registry from options.def's text (one macro per line), in the extension's order."""
    live, removed = [], []
    for line in text.splitlines():
        m = re.match(r"^(RESIDENT_(?:EXTERNAL_|REMOVED_)?OPTION)\((.*)\)\s*$", line)
        if not m:
            continue
        args = [_literal(t) for t in _TOKEN.findall(m.group(2))]
        if m.group(1) == "RESIDENT_REMOVED_OPTION":
            key, reason = args
            removed.append(_entry(key, "string", "removed", "", 0, 0, "", reason, "", True))
        elif m.group(1) == "RESIDENT_EXTERNAL_OPTION":
            key, reader, pg, kind, tier, default, lo, hi, choices, doc = args
            live.append(_entry(key, _KINDS[kind], _TIERS[tier], default, _number(lo), _number(hi),
                               choices, doc, reader, pg != "0"))
        else:
            key, _field, kind, tier, default, lo, hi, choices, doc = args
            live.append(_entry(key, _KINDS[kind], _TIERS[tier], default, _number(lo), _number(hi),
                               choices, doc, "Config", True))
    return live + removed


def _entry(key, kind, tier, default, lo, hi, choices, doc, reader, pg_option):
    return {"key": key, "variable": "RESIDENT_" + key.upper(), "kind": kind, "tier": tier,
            "default": default, "min": lo, "max": hi, "choices": choices, "doc": doc,
            "reader": reader, "pg_option": pg_option}


def from_def_file(path=DEF_PATH):
    with open(path, encoding="utf-8") as f:
        return parse_def(f.read())


def from_extension():
    """The extension's copy of the registry, or None when the extension does not load."""
    try:
        from resident_pg import _C
    except (ImportError, OSError):
        return None
    return [dict(o) for o in _C.options()]


def load():
    return from_extension() or from_def_file()


OPTIONS = load()
LIVE = [o for o in OPTIONS if o["tier"] != "removed"]
REMOVED = [o for o in OPTIONS if o["tier"] == "removed"]
BY_VARIABLE = {o["variable"]: o for o in OPTIONS}
PG_KEYS = tuple(o["key"] for o in LIVE if o["pg_option"])


def closest(name, pg_only=False):
    """The registered option nearest to ``name`` (a variable or a pg_options key), or None;
    with ``pg_only``, among the pg_options keys."""
    upper = str(name).upper()
    variable = upper if upper.startswith("RESIDENT_") else "RESIDENT_" + upper
    pool = [o["variable"] for o in LIVE if o["pg_option"] or not pg_only]
    near = difflib.get_close_matches(variable, pool, n=1, cutoff=0.6)
    return near[0] if near else None


def check_value(option, value):
    """None when ``value`` is valid for ``option``, else what is wrong with it."""
    if option["kind"] == "choice":
        choices = option["choices"].split("|")
        return None if value.strip().lower() in choices else f"not one of {', '.join(choices)}"
    if option["kind"] in ("unsigned", "int"):
        try:
            v = int(value)
        except ValueError:
            v = None
        if v is None or not option["min"] <= v <= option["max"]:
            return f"not an integer in [{option['min']}, {option['max']}]"
    return None


def default_text(option):
    return f"`{option['default']}`" if option["default"] else "(unset)"


def markdown():
    """docs/tuning.md's table of options, then the list of refused ones."""
    rows = ["| variable | default | tier | meaning |", "| --- | --- | --- | --- |"]
    for tier in TIERS:
        rows += [f"| `{o['variable']}` | {default_text(o)} | {tier} | {o['doc']} |"
                 for o in LIVE if o["tier"] == tier]
    rows += ["", "Refused: group creation fails with a `ValueError` naming the variable (or "
             "`pg_options` key) while one of these is set:", ""]
    rows += [f"- `{o['variable']}`: {o['doc']}" for o in REMOVED]
    return "\n".join(rows) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m resident_pg.options",
                                 description="The RESIDENT_* option registry.")
    ap.add_argument("--markdown", action="store_true", help="docs/tuning.md's option table")
    args = ap.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown())
    else:
        for o in LIVE:
            print(f"{o['variable']:<30} {o['default'] or '(unset)':<8} {o['tier']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
