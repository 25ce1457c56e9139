"""The detector on this machine and on written cpuinfo files, and what ``kiln plugins`` shows."""

import platform

import pytest
from kiln_x86 import detect
from kiln_x86.cpuinfo import cpu_features, is_x86_64

from kiln.testing import plugin_report

pytestmark = pytest.mark.plugin

ON_X86 = platform.machine() in ("x86_64", "AMD64")


def _flags_here() -> set[str]:
    with open("/proc/cpuinfo") as f:
        line = next(line for line in f if line.startswith("flags"))
    return set(line.split(":", 1)[1].split())


def test_machine_names():
    assert is_x86_64("x86_64") and is_x86_64("AMD64")
    assert not is_x86_64("aarch64") and not is_x86_64("ppc64le")


def test_features_from_a_cpuinfo_file(tmp_path):
    def features(text: str) -> dict[str, bool]:
        # Kiln reads a cpuinfo file once per path: each version gets its own.
        path = tmp_path / f"cpuinfo{len(list(tmp_path.iterdir()))}"
        path.write_text(text)
        return cpu_features(str(path))

    assert features(
        "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512vl\n\n"
        "processor\t: 1\nflags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512vl\n"
    ) == {
        "avx2": True,
        "avx512": True,
        "avx512_bf16": False,
        "amx": False,
    }
    # AMX needs its tiles and their bf16 multiply; AVX2 without FMA is not the AVX2 kernels need.
    assert features("flags\t\t: avx2 amx_tile avx512_bf16\n") == {
        "avx2": False,
        "avx512": False,
        "avx512_bf16": True,
        "amx": False,
    }
    # AVX-512 here means the foundation plus the byte/word and vector-length extensions.
    assert features("flags\t\t: avx2 fma avx512f avx512vl\n")["avx512"] is False
    assert not any(cpu_features(str(tmp_path / "missing")).values())


@pytest.mark.skipif(not ON_X86, reason="the detector activates on x86-64 only")
def test_detector_activates_here_and_kiln_plugins_shows_the_instruction_sets():
    assert detect() == "kiln_x86.platform.X86Platform"
    flags = _flags_here()
    expected = [
        name
        for name, present in (
            ("avx2", {"avx2", "fma"} <= flags),
            ("avx512", {"avx512f", "avx512bw", "avx512vl"} <= flags),
            ("avx512_bf16", "avx512_bf16" in flags),
            ("amx", {"amx_tile", "amx_bf16"} <= flags),
        )
        if present
    ]
    rc, report = plugin_report()
    assert rc == 0, report.get("error")
    assert report["platform"]["name"] == "x86"
    assert report["platform"]["reason"] == "the only out-of-tree platform that activated"
    assert report["platform"]["device_info"]["isa"] == expected


def test_the_reference_cpu_platform_stays_one_flag_away():
    rc, report = plugin_report(platform="cpu")
    assert rc == 0, report.get("error")
    assert report["platform"]["name"] == "cpu"
    assert not [i for i in report["op_implementations"] if i["provider"] == "kiln_x86"]


def test_kiln_x86_0_keeps_the_detector_inactive():
    rc, report = plugin_report(env={"KILN_X86": "0"})
    assert rc == 0, report.get("error")
    assert report["platform"]["name"] == "cpu"
    record = next(r for r in report["platform_plugins"] if r["name"] == "x86")
    assert record["status"] == "inactive"
