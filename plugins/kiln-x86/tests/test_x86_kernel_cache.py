"""The kernels' build cache: a build killed mid-way leaves no lock that blocks later processes,
and a build is named after its source, the headers it includes and its flags."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kiln_x86 import kernels

PROBE = """#include <pybind11/pybind11.h>
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("one", [] { return 1; }); }
"""
"""An extension of one function: it builds in seconds where the kernels take about a minute."""
LOAD_PROBE = (
    "import sys; from pathlib import Path; from kiln_x86.kernels import load_extension; "
    "module = load_extension('stale_lock_probe', Path(sys.argv[1])); "
    "print(None if module is None else module.one())"
)


def _load_probe(source, cache) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", LOAD_PROBE, str(source)],
        env={**os.environ, kernels.CACHE_ENV: str(cache)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _built_probe(tmp_path: Path) -> tuple[Path, Path, Path]:
    """The probe's source, cache and build folder, built there once (skips without a compiler)."""
    source, cache = tmp_path / "probe.cpp", tmp_path / "cache"
    source.write_text(PROBE)
    built = _load_probe(source, cache)
    if built.stdout.strip() == "None":
        pytest.skip("no compiler here: the kernels cannot be built")
    assert built.stdout.strip() == "1", built.stderr[-2000:]
    return source, cache, cache / kernels.extension_name("stale_lock_probe", source)


@pytest.mark.slow
def test_a_stale_torch_build_lock_does_not_block_loading(tmp_path) -> None:
    """torch's build lock is a file deleted when a build ends; one left by a killed build (here
    written by hand next to a finished build) made every later load wait forever."""
    source, cache, build_dir = _built_probe(tmp_path)
    assert any(build_dir.glob("*.so"))
    (build_dir / "lock").write_text("")
    done = _load_probe(source, cache)
    assert done.stdout.strip() == "1", done.stderr[-2000:]
    assert not (build_dir / "lock").exists()


def test_a_changed_shared_header_names_a_new_build(tmp_path) -> None:
    """The kernels include ``csrc/*.h``; a build cached under a name that hashed only the .cpp
    would keep serving the old header's code after an upgrade."""
    source = tmp_path / "kernel.cpp"
    source.write_text('#include "shared.h"\n')
    header = tmp_path / "shared.h"
    header.write_text("inline int f() { return 1; }\n")
    before = kernels.extension_name("k", source)
    header.write_text("inline int f() { return 2; }\n")
    assert kernels.extension_name("k", source) != before


def test_a_build_is_named_after_the_torch_build_not_its_folder(tmp_path) -> None:
    """Every fresh clone has its own virtual environment: a name that hashed torch's folder made
    each one rebuild every kernel (minutes of a CI run)."""
    source = tmp_path / "kernel.cpp"
    source.write_text("int f() { return 1; }\n")
    here = kernels.extension_name("k", source)
    assert kernels.extension_name("k", source, build=kernels.torch_build()) == here
    other = kernels.torch_build().replace(torch.__version__, "2.0.0")
    assert kernels.extension_name("k", source, build=other) != here


@pytest.mark.slow
def test_another_environments_build_loads_without_a_rebuild(tmp_path) -> None:
    """A build made by another virtual environment (whose build commands name its own torch
    folder: ninja's log of their hashes is edited here as that environment's would differ) is
    imported as it is; torch's loader would rebuild it."""
    source, cache, build_dir = _built_probe(tmp_path)
    (library,) = build_dir.glob("*.so")
    mtime = library.stat().st_mtime_ns
    log = build_dir / ".ninja_log"
    lines = log.read_text().splitlines()
    entries = [line.rsplit("\t", 1)[0] + "\t0000000000000000" for line in lines[1:]]
    assert entries, "ninja logged no build step"
    log.write_text("\n".join([lines[0], *entries]) + "\n")
    again = _load_probe(source, cache)
    assert again.stdout.strip() == "1", again.stderr[-2000:]
    assert library.stat().st_mtime_ns == mtime, "the library was rebuilt"


def test_a_header_renames_only_the_builds_that_include_it(tmp_path) -> None:
    """Each build hashes its source and the headers it includes, transitively: a change to a
    header that one kernel alone includes rebuilds that kernel, not every other (minutes each)."""
    (tmp_path / "a.cpp").write_text('#include <vector>\n#include "a.h"\nint a() { return f(); }\n')
    (tmp_path / "a.h").write_text('#pragma once\n#  include "common.h"\n')
    (tmp_path / "common.h").write_text("inline int f() { return 1; }\n")
    (tmp_path / "b.cpp").write_text('#include "b.h"\n// #include "common.h" (a comment)\n')
    (tmp_path / "b.h").write_text("inline int g() { return 1; }\n")

    def names() -> tuple[str, str]:
        return (
            kernels.extension_name("a", tmp_path / "a.cpp"),
            kernels.extension_name("b", tmp_path / "b.cpp"),
        )

    a, b = names()
    (tmp_path / "common.h").write_text("inline int f() { return 2; }\n")  # a's, through a.h
    a2, b2 = names()
    assert a2 != a and b2 == b
    (tmp_path / "b.h").write_text("inline int g() { return 2; }\n")  # b's alone
    a3, b3 = names()
    assert a3 == a2 and b3 != b2
    (tmp_path / "unused.h").write_text("int h();\n")  # nobody's
    assert names() == (a3, b3)
    assert kernels.included_files(tmp_path / "a.cpp") == [
        tmp_path / "a.cpp",
        tmp_path / "a.h",
        tmp_path / "common.h",
    ]


BUILD = """
import sys
from pathlib import Path
from pathlib import Path
from kiln_x86 import kernels
module = kernels.load_extension("twin", Path(sys.argv[1]) / "twin.cpp")
print(module.answer())
"""


def test_two_checkouts_of_one_source_share_its_build(tmp_path) -> None:
    """Two checkouts of the same source (a git worktree beside the main one) name the same
    build; each compiling its own path into it made every load from the other rebuild it."""
    checkouts = [tmp_path / "main" / "csrc", tmp_path / "worktree" / "csrc"]
    for csrc in checkouts:
        csrc.mkdir(parents=True)
        (csrc / "twin.h").write_text("inline int answer() { return 42; }\n")
        (csrc / "twin.cpp").write_text(
            '#include <pybind11/pybind11.h>\n#include "twin.h"\n'
            'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }\n'
        )
    cache = tmp_path / "cache"

    def load(csrc) -> None:
        done = subprocess.run(
            [sys.executable, "-c", BUILD, str(csrc)],
            env={**os.environ, kernels.CACHE_ENV: str(cache)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.stdout.strip() == "42", done.stderr[-2000:]

    load(checkouts[0])
    (library,) = cache.glob("twin_*/twin_*.so")
    built = library.stat().st_mtime_ns
    load(checkouts[1])
    assert library.stat().st_mtime_ns == built, "the second checkout rebuilt the kernel"
