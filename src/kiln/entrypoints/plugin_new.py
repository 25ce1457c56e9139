"""``kiln plugin new NAME``: write a complete platform plugin package that passes the kit as is.

The package (``kiln-NAME/``) holds a pyproject with both entry points, a platform with a config
section, a worker, a paged-attention backend, op implementations, the conformance kit's test module
and a README. The files come from ``plugin_template/`` (``*.tmpl``, ``string.Template`` syntax;
the directory ``__package__`` becomes ``kiln_NAME``). ``docs/plugins.md`` shows the files written
for ``NAME=toy`` and its test checks that they are the same.

This module knows nothing about plugin loading: it only writes files.
"""

from __future__ import annotations

import argparse
import keyword
import re
import string
import sys
from pathlib import Path

TEMPLATE_DIR = Path(__file__).with_name("plugin_template")
NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]{0,15}")
RESERVED_NAMES = ("cpu", "unspecified")
"""Platform names Kiln itself uses."""


def _check_identifier(field: str, value: str, what: str) -> None:
    if not NAME_PATTERN.fullmatch(value) or keyword.iskeyword(value) or value.endswith("_"):
        raise ValueError(
            f"{field}={value!r} is invalid; allowed: 1 to 16 characters, a lowercase letter "
            f"followed by lowercase letters, digits or underscores, not ending in '_' and not a "
            f"Python keyword ({what})"
        )


def template_values(name: str, device_type: str = "cpu") -> dict[str, str]:
    """The placeholders of the templates for plugin ``name`` on ``device_type``.

    Raises:
        ValueError: ``name`` or ``device_type`` is not allowed (the message says what is).
    """
    _check_identifier(
        "NAME", name, "it names the platform, both entry points, the config section and kiln_NAME"
    )
    if name in RESERVED_NAMES:
        raise ValueError(f"NAME={name!r} is taken by Kiln; allowed: any other name")
    _check_identifier(
        "--device-type",
        device_type,
        "a torch device type such as cpu, cuda, xpu, or your renamed PrivateUse1 backend",
    )
    return {
        "name": name,
        "NAME": name.upper(),
        "cls": "".join(part.capitalize() for part in name.split("_")),
        "package": f"kiln_{name}",
        "dist": "kiln-" + name.replace("_", "-"),
        "env": f"KILN_{name.upper()}",
        "device_type": device_type,
    }


def render_plugin(name: str, device_type: str = "cpu") -> dict[str, str]:
    """Relative path -> content of every file of the package.

    Raises:
        ValueError: ``name`` or ``device_type`` is not allowed.
    """
    values = template_values(name, device_type)
    files = {}
    for template in sorted(TEMPLATE_DIR.rglob("*.tmpl")):
        relative = template.relative_to(TEMPLATE_DIR).as_posix().removesuffix(".tmpl")
        relative = relative.replace("__package__", values["package"])
        files[relative] = string.Template(template.read_text()).substitute(values)
    return files


def write_plugin(name: str, directory: Path, device_type: str = "cpu") -> list[Path]:
    """Write the package for ``name`` into ``directory``, which must not exist yet.

    Returns:
        The files written.

    Raises:
        ValueError: ``name`` or ``device_type`` is not allowed.
        FileExistsError: ``directory`` exists (nothing is overwritten).
    """
    files = render_plugin(name, device_type)
    if directory.exists():
        raise FileExistsError(f"{directory} exists; choose another --directory or remove it")
    written = []
    for relative, content in files.items():
        path = directory / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        written.append(path)
    return written


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "name",
        metavar="NAME",
        help="the platform's name: entry points, --platform, the config section, kiln_NAME",
    )
    parser.add_argument(
        "--device-type",
        default="cpu",
        help="the torch device type of the platform's tensors (default: cpu)",
    )
    parser.add_argument(
        "--directory",
        type=Path,
        default=None,
        help="where to write the package (default: ./kiln-NAME); must not exist",
    )


def main(args: argparse.Namespace) -> int:
    directory = args.directory or Path("kiln-" + args.name.replace("_", "-"))
    try:
        written = write_plugin(args.name, directory, args.device_type)
    except (ValueError, FileExistsError) as exc:
        print(f"kiln plugin new: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} files to {directory}/:")
    for path in written:
        print(f"  {path.relative_to(directory)}")
    env = template_values(args.name, args.device_type)["env"]
    print(
        f"next: cd {directory} && python -m pip install -e . && "
        f"{env}=1 python -m pytest tests  (Kiln's conformance kit)"
    )
    return 0
