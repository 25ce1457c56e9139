"""``kiln plugin new``: what it writes, and what it refuses.

That the package it writes installs and passes the conformance kit is checked by
``tests/test_plugin_guide.py``, which runs the guide's commands (scaffold, install, kit).
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kiln.entrypoints.cli import main


def _files(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): p.read_text() for p in root.rglob("*") if p.is_file()}


def test_writes_a_complete_package(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    target = tmp_path / "pkg"
    args = ["plugin", "new", "npu_sim", "--device-type", "npu", "--directory", str(target)]
    assert main(args) == 0
    files = _files(target)
    assert set(files) == {
        "README.md",
        "pyproject.toml",
        "src/kiln_npu_sim/__init__.py",
        "src/kiln_npu_sim/attention.py",
        "src/kiln_npu_sim/ops.py",
        "src/kiln_npu_sim/platform.py",
        "src/kiln_npu_sim/worker.py",
        "tests/test_kiln_conformance.py",
    }
    project = tomllib.loads(files["pyproject.toml"])
    entry_points = project["project"]["entry-points"]
    assert entry_points["kiln.platform_plugins"] == {"npu_sim": "kiln_npu_sim:detect"}
    assert entry_points["kiln.general_plugins"] == {"npu_sim": "kiln_npu_sim:register"}
    assert project["project"]["name"] == "kiln-npu-sim"
    platform = files["src/kiln_npu_sim/platform.py"]
    assert 'name = "npu_sim"' in platform and 'device_type = "npu"' in platform
    assert "class NpuSimOptions" in platform and "config_section = NpuSimOptions" in platform
    assert 'return "npu_sim"' in files["tests/test_kiln_conformance.py"]
    assert "$" not in "".join(v for k, v in files.items() if k.endswith(".py"))  # all substituted
    assert "wrote 8 files" in capsys.readouterr().out


def test_written_code_is_ruff_clean_at_the_longest_name(tmp_path: Path) -> None:
    """The generated package is code its author keeps: lint- and format-clean at Kiln's line
    length for every allowed name length."""
    for name in ("t", "abcdefghij_klmno"):
        assert main(["plugin", "new", name, "--directory", str(tmp_path / name)]) == 0
    ruff = [sys.executable, "-m", "ruff"]
    for args in (["check", "--no-cache"], ["format", "--check", "--no-cache"]):
        proc = subprocess.run(
            [*ruff, *args, "--line-length", "100", str(tmp_path)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
    for path in tmp_path.rglob("*.py"):
        compile(path.read_text(), str(path), "exec")


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["Bad-Name"], "NAME='Bad-Name'"),
        (["1abc"], "NAME='1abc'"),
        (["class"], "NAME='class'"),
        (["x" * 17], "NAME='xxxxxxxxxxxxxxxxx'"),
        (["toy_"], "NAME='toy_'"),
        (["cpu"], "NAME='cpu' is taken by Kiln"),
        (["toy", "--device-type", "CUDA"], "--device-type='CUDA'"),
    ],
)
def test_bad_arguments_are_refused_naming_them(
    args: list[str], field: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    target = tmp_path / "out"
    assert main(["plugin", "new", *args, "--directory", str(target)]) == 2
    err = capsys.readouterr().err
    assert field in err and "allowed" in err, err
    assert not target.exists()


def test_an_existing_directory_is_never_overwritten(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    target = tmp_path / "kiln-toy"
    target.mkdir()
    (target / "mine.txt").write_text("keep")
    assert main(["plugin", "new", "toy", "--directory", str(target)]) == 2
    assert "exists" in capsys.readouterr().err
    assert _files(target) == {"mine.txt": "keep"}


def test_default_directory_is_kiln_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["plugin", "new", "my_dev"]) == 0
    assert (tmp_path / "kiln-my-dev" / "src" / "kiln_my_dev" / "platform.py").is_file()
    assert "KILN_MY_DEV=1" in capsys.readouterr().out
