"""The kernels' build cache: a build killed mid-way leaves no lock that blocks later processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from kiln_x86 import kernels

LOAD = "from kiln_x86.kernels import load_kernels; print(load_kernels() is not None)"


@pytest.mark.slow
def test_a_stale_torch_build_lock_does_not_block_loading(tmp_path) -> None:
    """torch's build lock is a file deleted when a build ends; one left by a killed build (here
    written by hand next to a finished build) made every later load wait forever."""
    if kernels.load_kernels() is None:
        pytest.skip("no compiler here: the kernels cannot be built")
    name = kernels.extension_name()
    shutil.copytree(kernels.cache_dir() / name, tmp_path / name)
    (tmp_path / name / "lock").write_text("")
    done = subprocess.run(
        [sys.executable, "-c", LOAD],
        env={**os.environ, kernels.CACHE_ENV: str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.stdout.strip() == "True", done.stderr[-2000:]
    assert not (tmp_path / name / "lock").exists()


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
