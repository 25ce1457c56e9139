"""Builds and loads kiln-x86's C++ kernels (``csrc/x86_ops.cpp``), once per machine.

Contract: ``load_kernels()`` returns the compiled module (``rms_norm``, ``silu_and_mul``,
``rotary_embedding``; the same ops are also ``torch.ops.kiln_x86.*``), building it on first use
with ``torch.utils.cpp_extension.load`` into a cache directory that later processes, of any
checkout or virtual environment with the same torch build, import as it is:
``$KILN_X86_CACHE_DIR``, else ``$XDG_CACHE_HOME/kiln-x86`` (``~/.cache/kiln-x86``). The build is
compiled for this CPU (``-march=native``), so its name carries the instruction sets found, and a
machine with other ones builds its own. It returns None, once logged, when the build fails (no
compiler): callers then keep the reference implementations. ``python -m kiln_x86.kernels``
builds every kernel family ahead of time, one compiler process per core (Kiln's set-up script
does). ``load_extension(stem, source)`` builds and loads another source of ``csrc/`` the same
way (``x86_attention.cpp``: ``kiln_x86.attention``;
``x86_quant.cpp``: ``kiln_x86.quant``; ``x86_gemv.cpp``: ``kiln_x86.gemv``; ``x86_lora.cpp``:
``kiln_x86.lora``; ``x86_moe.cpp``: ``kiln_x86.moe``; ``x86_dense.cpp``: ``kiln_x86.dense``).
An extension with an ``attach_pool`` function runs its parallel loops on the work pool of
``x86_gemv.cpp`` (``csrc/work_pool.h``), attached as it loads: the process has one set of helper
threads (``x86.helper_threads``), whichever kernels they serve.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import logging
import multiprocessing
import os
import re
import sysconfig
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

from kiln_x86.cpuinfo import cpu_features

logger = logging.getLogger(__name__)

CACHE_ENV = "KILN_X86_CACHE_DIR"
SOURCE = Path(__file__).parent / "csrc" / "x86_ops.cpp"
OPENMP = ["-fopenmp"]
"""Compiler and linker flag of every build: ``at::parallel_for`` is an OpenMP loop only where
the extension is compiled with OpenMP (without, ATen's header runs it as one serial call). The
extension then links ``libgomp.so.1``, which resolves to the runtime torch already loaded (the
same soname), so ``torch.set_num_threads`` sets its team size too."""
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", *OPENMP]

ATTENTION_SOURCE = Path(__file__).parent / "csrc" / "x86_attention.cpp"
ATTENTION_CFLAGS = ["-O3", "-march=native", "-ffp-contract=fast", *OPENMP]
"""Products may fuse into FMAs here: attention matches the reference to float32 precision, not
bit for bit (its sums run in another order anyway)."""

_STATE: dict[str, ModuleType | None] = {}


@contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Hold ``build_dir``'s build lock: one process builds or loads it at a time.

    torch's own lock is a file it deletes when a build ends, so a build killed mid-way (Ctrl-C
    on a first start) leaves it behind and every later process waits on it forever. This lock
    is an ``flock``, which the kernel releases when its holder dies; whoever holds it is the only
    process in torch's build step, so a torch lock file found then is stale and removed.
    """
    with open(build_dir / ".kiln-x86.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kiln-x86"
    )
    return Path(root)


INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)
"""A quoted ``#include`` line: a file of ``csrc/`` (``<...>`` ones are the toolchain's)."""


def included_files(source: Path) -> list[Path]:
    """``source`` and every file it includes with ``#include "..."``, transitively, each once:
    ``source`` first, then the headers by path. A header is looked up beside the file that
    includes it (where the compiler looks first); one not there is left to the compiler. Every
    such line counts, in an ``#if`` or not, so a build is never named after less than it
    compiles."""
    found = {source}
    pending = [source]
    while pending:
        path = pending.pop()
        for name in INCLUDE.findall(path.read_bytes()):
            header = path.parent / name.decode()
            if header not in found and header.is_file():
                found.add(header)
                pending.append(header)
    return [source, *sorted(found - {source})]


def torch_build() -> str:
    """This interpreter's torch build (version and commit) and Python ABI: an extension built
    against them loads in every environment that has them, wherever torch is installed (it
    links torch's libraries by name, and torch has loaded them already)."""
    import torch

    abi = sysconfig.get_config_var("EXT_SUFFIX")
    return f"{torch.__version__} {torch.version.git_version} {abi}"


def extension_name(
    stem: str = "kiln_x86_ops",
    source: Path = SOURCE,
    cflags: list[str] = CFLAGS,
    build: str | None = None,
) -> str:
    """``<stem>_<isa>_<hash of source, the headers it includes, flags and torch build>``: one
    build per CPU kind, source and torch build (``build``, default ``torch_build()``), shared by
    every checkout and virtual environment on the machine. A header's change rebuilds the kernels
    that include it, and only those."""
    isa = "_".join(name for name, present in cpu_features().items() if present) or "base"
    data = b"".join(path.read_bytes() for path in included_files(source))
    toolchain = build if build is not None else torch_build()
    digest = hashlib.sha256(data + " ".join([*cflags, toolchain]).encode()).hexdigest()[:10]
    return f"{stem}_{isa}_{digest}"


def _import_built(name: str, library: Path) -> ModuleType | None:
    """The extension ``name`` from its built ``library``, or None where it is not built yet.
    Imported as it is, not through ``cpp_extension.load``: that rebuilds a library whose build
    command changed, and the command names the torch folder of the environment that built it
    (a fresh clone's virtual environment then rebuilt every kernel)."""
    if not library.exists():
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _copy_sources(source: Path, build_dir: Path) -> Path:
    """``source`` and the headers it includes, copied into ``build_dir/src`` (rewritten only
    where they differ): the build compiles the copy, so its command line names the same path
    from every checkout. Compiled in place, two checkouts of one source (a git worktree, a
    second clone) shared the build's name but not its command, and each load by the other
    rebuilt it (minutes). The build's name hashes these same files, so the copy is what it
    names."""
    folder = build_dir / "src"
    folder.mkdir(exist_ok=True)
    for path in included_files(source):
        copy = folder / path.relative_to(source.parent)
        copy.parent.mkdir(parents=True, exist_ok=True)
        data = path.read_bytes()
        if not copy.is_file() or copy.read_bytes() != data:
            copy.write_bytes(data)
    return folder / source.name


def load_kernels() -> ModuleType | None:
    """The compiled kernels (built into the cache on first use), or None if they cannot be
    built here."""
    return load_extension("kiln_x86_ops", SOURCE)


def load_extension(stem: str, source: Path, cflags: list[str] = CFLAGS) -> ModuleType | None:
    """The C++ extension built from ``source`` with ``cflags`` (into the cache on first use,
    named after ``stem``), or None, once logged, if it cannot be built here."""
    if stem in _STATE:
        return _STATE[stem]
    name = extension_name(stem, source, cflags)
    build_dir = cache_dir() / name
    library = build_dir / f"{name}.so"  # where cpp_extension.load writes it
    cached = library.exists()
    if not cached:
        logger.warning(
            "kiln-x86: compiling its C++ kernels (%s) into %s (once per machine; about a minute)",
            source.name,
            build_dir,
        )
    start = time.perf_counter()
    # torch looks for `ninja` on PATH; the pip-installed one sits beside this interpreter, which
    # need not be on PATH (.venv/bin/python run without activating the venv).
    scripts = sysconfig.get_path("scripts")
    path = os.environ.get("PATH", "")
    if scripts not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([p for p in (path, scripts) if p])
    try:
        from torch.utils import cpp_extension

        build_dir.mkdir(parents=True, exist_ok=True)
        with _build_lock(build_dir):
            module = _import_built(name, library) or cpp_extension.load(
                name=name,
                sources=[str(_copy_sources(source, build_dir))],
                extra_cflags=cflags,
                extra_ldflags=OPENMP,
                build_directory=str(build_dir),
                verbose=False,
            )
    except Exception as exc:  # no compiler, no headers: run the reference ops instead
        logger.error("kiln-x86: could not build its kernels, using Kiln's reference ops: %s", exc)
        module = None
    else:
        if not cached:
            logger.warning("kiln-x86: kernels built in %.0f s", time.perf_counter() - start)
    _STATE[stem] = module
    if module is not None and hasattr(module, "attach_pool"):
        _attach_pool(module)
    return module


def _attach_pool(module: ModuleType) -> None:
    """``module``'s parallel loops go to the matmul extension's work pool, where it builds."""
    from kiln_x86 import gemv  # imports this module: loaded here, not at the top

    pool = gemv.extension()
    if pool is not None:
        module.attach_pool(pool.pool_handle())


def _loaders() -> list[Callable[[], object]]:
    """Every kernel family's loader, the matmul extension first (the others attach to its work
    pool, so they build after it)."""
    from kiln_x86.dense import load_dense_kernels  # csrc/x86_dense.cpp (dense bf16 matmul)
    from kiln_x86.gemv import load_gemv_kernels  # csrc/x86_gemv.cpp (tiled int8 matmul)
    from kiln_x86.lora import load_lora_kernels  # csrc/x86_lora.cpp (LoRA at decode sizes)
    from kiln_x86.moe import load_moe_kernels  # csrc/x86_moe.cpp (fused_moe at decode sizes)
    from kiln_x86.quant import load_quant_kernels  # csrc/x86_quant.cpp (GGUF matmul)

    return [
        load_gemv_kernels,
        load_kernels,
        functools.partial(load_extension, "kiln_x86_attention", ATTENTION_SOURCE, ATTENTION_CFLAGS),
        load_quant_kernels,
        load_lora_kernels,
        load_moe_kernels,
        load_dense_kernels,
    ]


def _build_one(index: int) -> bool:
    """Build (or find in the cache) ``_loaders()[index]``'s kernels; True where they load."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return _loaders()[index]() is not None


def build_all() -> bool:
    """Build every kernel family into the cache, one process per core at a time (each build is
    one compiler process: built one after another, a 2-core machine compiled on one core), then
    load them all here. True where every one loads."""
    jobs = min(len(_loaders()), len(os.sched_getaffinity(0)))
    if jobs > 1:
        # spawn: a fresh interpreter per build, as a first `kiln serve` would be.
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(jobs, mp_context=context) as pool:
            list(pool.map(_build_one, range(len(_loaders()))))
    return all(load() is not None for load in _loaders())


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = build_all()
    print(f"kiln-x86 kernels: {'ready' if built else 'NOT built'} in {cache_dir()}")
    raise SystemExit(0 if built else 1)
