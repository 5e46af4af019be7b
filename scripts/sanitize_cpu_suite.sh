#!/usr/bin/env bash
# The CPU test suite under AddressSanitizer and UndefinedBehaviorSanitizer.
#
# Builds resident_pg._C with -fsanitize=address,undefined into its own directory (the in-place
# build and an installed copy stay as they are), puts that package first on PYTHONPATH, preloads
# the sanitizer runtimes into every process the tests start (Python itself is not instrumented)
# and runs pytest. The core's C++ unit tests (tests/test_core_cpp.py) are compiled with the same
# flags through RESIDENT_TEST_CXXFLAGS. Every report goes to a file per process under the output
# directory; the script ends with pytest's summary, the number of reports and their first lines,
# and exits non-zero when pytest failed or any sanitizer reported.
#
#   scripts/sanitize_cpu_suite.sh                       # the whole CPU suite (tests/)
#   scripts/sanitize_cpu_suite.sh tests/test_faults.py -k timeout   # any pytest arguments
#
# Environment: RESIDENT_SANITIZE_DIR (build and reports; default build-sanitize/ in the repo),
# RESIDENT_SANITIZE_SKIP_BUILD=1 (reuse the last build), RESIDENT_SANITIZE_LEAKS=1 (LeakSanitizer
# on: it then also reports what the shells and tools the tests start never free, so it is off
# by default),
# MAX_JOBS (compile jobs, default 2).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${RESIDENT_SANITIZE_DIR:-$ROOT/build-sanitize}"
SAN_FLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer"
PKG="$OUT/lib"
REPORTS="$OUT/reports"

if [[ "${RESIDENT_SANITIZE_SKIP_BUILD:-0}" != "1" ]]; then
  mkdir -p "$OUT/temp" "$PKG"
  echo "== building the sanitized extension into $PKG (log: $OUT/build.log)"
  (cd "$ROOT" && CFLAGS="$SAN_FLAGS -g" LDFLAGS="-fsanitize=address,undefined" \
    MAX_JOBS="${MAX_JOBS:-2}" python setup.py build_ext --build-temp "$OUT/temp" \
    --build-lib "$PKG" >"$OUT/build.log" 2>&1) || {
    tail -40 "$OUT/build.log"
    echo "sanitized build failed" >&2
    exit 2
  }
fi
# The package's Python files beside the sanitized _C (copied each run: they may have changed).
mkdir -p "$PKG/resident_pg"
cp "$ROOT"/resident_pg/*.py "$PKG/resident_pg/"
# Python puts a script's directory or the working directory first on sys.path, and several tests
# run Python in the repository, whose in-place build would win over PYTHONPATH. A finder ahead
# of the others (installed by this sitecustomize in every Python process on PYTHONPATH) resolves
# resident_pg to the sanitized copy, and nothing is imported before it is asked for.
cat >"$PKG/sitecustomize.py" <<EOF
import importlib.machinery
import sys


class SanitizedResidentPg:
    """resident_pg from $PKG (scripts/sanitize_cpu_suite.sh)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "resident_pg":
            return importlib.machinery.PathFinder.find_spec(name, ["$PKG"])
        return None


sys.meta_path.insert(0, SanitizedResidentPg)
EOF
SO="$(ls "$PKG"/resident_pg/_C*.so 2>/dev/null | head -1)"
[[ -n "$SO" ]] || { echo "no sanitized _C in $PKG/resident_pg" >&2; exit 2; }

ASAN_RT="$(gcc -print-file-name=libasan.so)"
UBSAN_RT="$(gcc -print-file-name=libubsan.so)"
rm -rf "$REPORTS"
mkdir -p "$REPORTS"

leaks=0
[[ "${RESIDENT_SANITIZE_LEAKS:-0}" == "1" ]] && leaks=1
# protect_shadow_gap=0: the CUDA driver maps memory where ASan keeps its shadow gap.
# Python and torch are not instrumented: ODR and link-order checks would only see their symbols.
export ASAN_OPTIONS="log_path=$REPORTS/asan:detect_leaks=$leaks:protect_shadow_gap=0:verify_asan_link_order=0:detect_odr_violation=0:abort_on_error=1:print_summary=1"
export UBSAN_OPTIONS="log_path=$REPORTS/ubsan:print_stacktrace=1:halt_on_error=0"
export LSAN_OPTIONS="log_path=$REPORTS/lsan"
export LD_PRELOAD="$ASAN_RT:$UBSAN_RT${LD_PRELOAD:+:$LD_PRELOAD}"
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
export RESIDENT_TEST_CXXFLAGS="$SAN_FLAGS"
export PYTHONMALLOC=malloc  # Python's own allocator would hide its blocks from ASan

echo "== resident_pg from: $(cd "$ROOT" && python -c 'import resident_pg._C as c; print(c.__file__)')"
cd "$ROOT"
set +e
if [[ $# -gt 0 ]]; then
  python -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$OUT/pytest.log"
else
  python -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest.log"
fi
status=${PIPESTATUS[0]}
set -e
unset LD_PRELOAD

shopt -s nullglob
reports=("$REPORTS"/*)
echo "== sanitizer reports: ${#reports[@]} file(s) in $REPORTS"
for f in "${reports[@]}"; do
  echo "-- $(basename "$f"):"
  grep -m3 -E "ERROR: AddressSanitizer|runtime error|ERROR: LeakSanitizer|SUMMARY" "$f" || head -5 "$f"
done
if [[ ${#reports[@]} -gt 0 ]]; then
  exit 1
fi
exit "$status"
