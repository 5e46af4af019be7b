"""Writes a gate baseline (benchmarks/baselines/*.json, pytest-benchmark's JSON format) from a
ladder document of ``python -m resident_pg.bench --json`` (plain or .gz), with the cases named as
``pytest benchmarks/`` names them.

    python benchmarks/baselines/transcribe.py LADDER.json[.gz] -o benchmarks/baselines/X.json \
        --note "what machine, which run"
"""

import argparse
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from resident_pg.bench import cases  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ladder_json")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--note", required=True, help="the machine and the run it was taken from")
    a = ap.parse_args(argv)
    opener = gzip.open if a.ladder_json.endswith(".gz") else open
    with opener(a.ladder_json, "rt") as f:
        doc = json.load(f)
    if doc.get("schema") != "resident_pg.bench/1":
        ap.error(f"{a.ladder_json}: schema {doc.get('schema')!r}, expected resident_pg.bench/1")
    out = cases.baseline_from_doc(doc, f"{a.note} (transcribed from {os.path.basename(a.ladder_json)})")
    with open(a.output, "w") as f:
        json.dump(out, f, separators=(",", ":"))
    print(f"{a.output}: {len(out['benchmarks'])} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
