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
