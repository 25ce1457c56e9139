"""``kiln.platforms.cpu_flags`` (documented for plugins) on written cpuinfo files, and the cpu
platform's choices made from it."""

from __future__ import annotations

import inspect
import pathlib

import pytest

from kiln.platforms import CPUINFO_PATH, cpu_batch_invariant, cpu_flags
from kiln.platforms import cpu as cpu_platform

TWO_PROCESSORS = (
    "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx2 avx512_bf16\n\n"
    "processor\t: 1\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx2 avx512_bf16 amx_bf16\n"
)


def test_the_first_processors_flags(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(TWO_PROCESSORS)
    assert cpu_flags(str(path)) == frozenset({"fpu", "sse2", "avx2", "avx512_bf16"})


def test_no_flags_where_there_is_no_file_or_no_flags_line(tmp_path):
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd evtstrm aes\n")
    assert cpu_flags(str(arm)) == frozenset()


def test_read_once_per_path(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("flags\t\t: avx2\n")
    assert cpu_flags(str(path)) == {"avx2"}
    path.write_text("flags\t\t: avx2 amx_bf16\n")
    assert cpu_flags(str(path)) == {"avx2"}


def test_this_machine_is_read_by_default():
    default = inspect.signature(cpu_flags).parameters["cpuinfo"].default
    assert default == CPUINFO_PATH == "/proc/cpuinfo"
    if not pathlib.Path(CPUINFO_PATH).exists():
        pytest.skip("no /proc/cpuinfo here")
    with open(CPUINFO_PATH) as f:
        line = next((line for line in f if line.startswith("flags")), "flags:")
    assert cpu_flags() == set(line.split(":", 1)[1].split())


@pytest.mark.parametrize(
    ("flags", "native_bf16", "row_tile"),
    [
        ({"avx2", "avx512f"}, False, 1),
        ({"avx512f", "avx512_bf16"}, True, 1),  # no AMX: one row per oneDNN call
        ({"amx_tile", "amx_bf16"}, True, cpu_batch_invariant.AMX_ROW_TILE),
    ],
)
def test_the_cpu_platform_decides_from_them(monkeypatch, flags, native_bf16, row_tile):
    for module in (cpu_platform, cpu_batch_invariant):
        monkeypatch.setattr(module, "cpu_flags", lambda: frozenset(flags))
    assert cpu_platform.has_native_bf16() is native_bf16
    assert cpu_batch_invariant.row_tile() == row_tile


def test_cpu_flags_is_in_the_plugin_api():
    guide = (pathlib.Path(__file__).parents[2] / "docs" / "plugins.md").read_text()
    section = guide[guide.index("## 6. What a plugin may import") :]
    assert "| `cpu_flags` | `cpu_flags()`:" in section
    from kiln import plugin_api
    from kiln.platforms import cpu_flags

    assert plugin_api.cpu_flags is cpu_flags
