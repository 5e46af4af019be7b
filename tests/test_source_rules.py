"""Rules of the C++/CUDA sources that a compiler does not enforce.

No iostreams: the extension shares its process with torch, and libstdc++ stream code in the
extension has clashed with the host's on the GPU machine (torch 2.11; the note in `localHostKey`,
csrc/core/communicator.cpp), and the proxy trace's ofstream crashed both ranks with SIGSEGV at
shutdown, leaving an empty file.
The core uses stdio (fopen/fprintf/fgets) for files and the logger for messages.
"""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
STREAM_HEADERS = re.compile(r"^\s*#\s*include\s*<(fstream|iostream|sstream|istream|ostream)>",
                            re.MULTILINE)


def _sources():
    for top in ("csrc", "kernels"):
        for p in sorted((ROOT / top).rglob("*")):
            if p.suffix in (".cpp", ".hpp", ".cu", ".cuh", ".h", ".cc"):
                yield p


def test_sources_found():
    names = {p.name for p in _sources()}
    # The files the rule is mostly about: a rename must not silently empty the scan.
    assert {"proxy_trace.hpp", "communicator.cpp", "ib_caps.cpp"} <= names


def test_no_iostreams_in_the_extension():
    offenders = []
    for p in _sources():
        text = p.read_text()
        for m in STREAM_HEADERS.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            offenders.append(f"{p.relative_to(ROOT)}:{line}: <{m.group(1)}>")
    assert not offenders, ("iostreams in the extension (use stdio; see this test's docstring): "
                           + ", ".join(offenders))


# Words of the project's own history: the tree says what the software does and, where it
# matters, the command that measures it; when something was found or changed is git's.
HISTORY_TOPS = ("csrc", "kernels", "resident_pg", "tests", "scripts", "benchmarks", "examples",
                "docs", "README.md")
# Measured data (raw logs and JSON) is not prose of the tree.
HISTORY_SKIP = ("benchmarks/data/", "tests/data/")
HISTORY_WORDS = [
    ("session N", re.compile(r"\bsessions? \d+", re.I)),
    # A device call by number ("call 4", "calls 3 and 4"), not a time ("the call 4.37 us").
    ("call N", re.compile(r"\bcalls? \d+(?![.\d])(?!\s*(?:us|µs|ns|ms)\b)", re.I)),
    ("attempt N", re.compile(r"\battempts? \d+", re.I)),
    ("the final code", re.compile(r"\bthe final (?:code|tree|version)\b", re.I)),
    ("issue N", re.compile(r"\bissues?[- ]#?\d+", re.I)),
    # An issue or pull request by number; "gloo#2" (a label) and "#1" inside a word are not.
    ("#N", re.compile(r"(?<![\w#&/])#\d+\b")),
    ("previously", re.compile(r"\b(?:previously|formerly)\b", re.I)),
    # "used to" of a habit in the past; "the path used to reach a peer" (a purpose) is not.
    ("used to", re.compile(r"\b(?:it|this|that|which|we|they|there|code|kernel|proxy|script|"
                           r"test|benchmark|path|stage) used to (?!reach|plan|build|hold|"
                           r"check|compute|run|select|store|find|pick|make|pass|send|map)",
                           re.I)),
    ("no longer", re.compile(r"\bno longer (?:needed|necessary|used|applies|happens|does|"
                             r"the case|required)\b", re.I)),
]


def _tracked_text_files():
    import subprocess

    out = subprocess.run(["git", "ls-files", "-z", "--", *HISTORY_TOPS], cwd=ROOT,
                         capture_output=True, check=True).stdout
    for rel in sorted(set(out.decode().split("\0")) - {""}):
        if rel.startswith(HISTORY_SKIP):
            continue
        p = ROOT / rel
        if not p.is_file():  # deleted in the working tree
            continue
        data = p.read_bytes()
        if b"\0" in data[:8192]:  # binary
            continue
        try:
            yield rel, data.decode("utf-8")
        except UnicodeDecodeError:
            continue


def _history_hits(text):
    for name, pattern in HISTORY_WORDS:
        for m in pattern.finditer(text):
            yield name, m


def test_history_patterns_catch_history_and_pass_normal_code():
    """The patterns on sentences written both ways (a pattern that matches nothing would let
    every file pass)."""
    history = [
        "bool current; // false: the rules before session 18",
        "sessions 22-24 in the record", "(call 4, 15:09 UTC)", "calls 3 and 4 kept it",
        "attempt 2 hung", "checked whole: the final code on the H200", "the issue-3 targets",
        "see issue 35", "fixed in #12", "previously a memcpy", "the script used to fold credits",
        "this is no longer needed",
    ]
    normal = [
        "an MPI session", "a profiling session", "scope=\"session\"", "request.session",
        "the syscall", "the backend's own call 4.37 µs", "a call to recv",
        "'gloo', 'gloo#2'", "#include <cstdint>", "Transport used to reach a peer",
        "processes that no longer exist", "this process group can no longer be used",
        "used to plan the batch", "#pragma once", "&#32;",
    ]
    caught = [h for h in history if not any(True for _ in _history_hits(h))]
    assert not caught, f"history sentences not caught: {caught}"
    tripped = [(n, [name for name, _ in _history_hits(n)]) for n in normal
               if any(True for _ in _history_hits(n))]
    assert not tripped, f"normal phrases caught: {tripped}"


def test_no_history_words_in_sources_and_docs():
    files = list(_tracked_text_files())
    names = {rel for rel, _ in files}
    # The scan must reach every kind of file it is about.
    assert {"README.md", "docs/architecture.md", "scripts/device_run.sh",
            "csrc/core/proxy/proxy_trace.hpp", "tests/test_source_rules.py"} <= names
    offenders = []
    for rel, text in files:
        if rel == "tests/test_source_rules.py":  # this file's own examples
            continue
        for name, m in _history_hits(text):
            line_no = text.count("\n", 0, m.start()) + 1
            line = text.splitlines()[line_no - 1].strip()
            offenders.append(f"{rel}:{line_no}: [{name}] {line[:120]}")
    assert not offenders, ("words of the project's history (state the fact and the command "
                           "that measures it; history is git's):\n" + "\n".join(offenders))


# Data in the tree is what the docs cite or the tests use (by name, or by a brace pattern such
# as `interference_ws{2,4,8}_h200_2026-11-30.{json.gz,log}`); the rest is git's. The citing text
# is every tracked text file the history scan reads (which leaves the data itself out).
DATA_DIRS = ("benchmarks/data", "tests/data")
BRACED = re.compile(r"[\w.-]*\{[\w.,-]*\}[\w.{},-]*")


def _expand(pattern):
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    out = []
    for alt in m.group(1).split(","):
        out += _expand(pattern[:m.start()] + alt + pattern[m.end():])
    return out


def test_data_files_are_cited():
    import subprocess

    text = "\n".join(t for _, t in _tracked_text_files())
    cited = {name for m in BRACED.finditer(text) for name in _expand(m.group(0))}
    data = subprocess.run(["git", "ls-files", "-z", "--", *DATA_DIRS], cwd=ROOT,
                          capture_output=True, check=True).stdout.decode().split("\0")
    uncited = [rel for rel in sorted(set(data) - {""})
               if (ROOT / rel).is_file() and rel.rsplit("/", 1)[-1] not in cited
               and rel.rsplit("/", 1)[-1] not in text and not rel.endswith("README.md")]
    assert not uncited, ("data files that no doc cites and no test uses (remove them, git keeps "
                         "them, or cite them): " + ", ".join(uncited))


def test_data_citation_patterns_expand():
    assert _expand("a_{1,2}.{x,y}") == ["a_1.x", "a_1.y", "a_2.x", "a_2.y"]


# Every kernel is loaded before a device's first op (loadKernelsOnce in
# csrc/cuda/gpu_communicator.cpp calls each file's load function): under CUDA's lazy module
# loading a first launch may wait for the running kernels, which can be a recv waiting for a
# peer stuck in such a load of its own (kernels/collective_launch.hpp). A kernel added to a file
# without being named in its loadFunctions list would bring that back.
KERNEL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(")
LOADED = re.compile(r"loadFunctions\(\s*\{(.*?)\}\s*\)", re.DOTALL)


def test_every_kernel_is_loaded_ahead():
    files = sorted((ROOT / "kernels").glob("*.cu"))
    assert len(files) >= 5
    missing = []
    for p in files:
        text = p.read_text()
        loaded = " ".join(LOADED.findall(text))
        for name in KERNEL.findall(text):
            if not re.search(rf"\b{name}\b", loaded):
                missing.append(f"{p.relative_to(ROOT)}: {name}")
    assert not missing, ("kernels not named in their file's loadFunctions list (see this "
                         "test's comment): " + ", ".join(missing))
    caller = (ROOT / "csrc" / "cuda" / "gpu_communicator.cpp").read_text()
    body = caller[caller.index("void loadKernelsOnce("):]
    body = body[:body.index("\n}\n")]
    for fn in ("loadCollectiveKernels", "loadSplitsKernels", "loadOneRoundKernels",
               "loadP2PKernels", "ep::loadKernels"):
        assert f"{fn}()" in body, f"loadKernelsOnce does not call {fn}"


# One concept per file: code (C++, CUDA, Python, shell) stays under ~600 lines, so a file that
# grows past it is split by concept rather than left to grow. Docs and data are not code.
CODE_SUFFIXES = (".cpp", ".hpp", ".cu", ".cuh", ".h", ".cc", ".py", ".sh")
MAX_CODE_LINES = 600


def test_code_files_stay_under_the_line_limit():
    files = [(rel, text) for rel, text in _tracked_text_files() if rel.endswith(CODE_SUFFIXES)]
    names = {rel for rel, _ in files}
    assert {"csrc/core/communicator.cpp", "kernels/collective_kernel.cu", "tests/op_mix.py",
            "scripts/device_run.sh"} <= names
    long = sorted(f"{rel}: {text.count(chr(10))} lines" for rel, text in files
                  if text.count("\n") > MAX_CODE_LINES)
    assert not long, (f"code files over {MAX_CODE_LINES} lines (split them by concept):\n"
                      + "\n".join(long))
