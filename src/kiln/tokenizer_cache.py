"""transformers' fast tokenizer of a GGUF file, converted once per file and kept on disk.

Contract: ``gguf_fast_tokenizer(path)`` returns what
``PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)`` returns for GGUF file
``path`` (the same vocabulary, merges, special and added tokens, and class). The first call for a
file converts its vocabulary (0.3-0.7 s) and keeps the result as a tokenizer folder under
``KILN_TOKENIZER_CACHE`` (default ``~/.cache/kiln/tokenizers``; ``0`` turns the cache off); later
calls, in any process, read that folder (about 0.1 s). Entries are keyed by the file (real path,
size, modification time) and the versions of ``transformers`` and ``tokenizers``, so a file
changed in place or a library upgrade converts again.

- An entry appears whole or not at all (saved into a folder beside it, then renamed); one that
  does not load (torn, emptied) is removed and converted again, never an error.
- A cache that cannot be written (read-only, full, a file in the way) is skipped.
- The ``TOKENIZER_CACHE_ENTRIES`` most recently used entries are kept; what a writer that crashed
  left behind goes after an hour.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from typing import Any

logger = logging.getLogger(__name__)

TOKENIZER_CACHE_ENV = "KILN_TOKENIZER_CACHE"
"""A directory for converted GGUF tokenizers, or ``0`` for none."""
TOKENIZER_CACHE_ENTRIES = 32
"""Entries kept; the least recently used go first (a GGUF moved or replaced leaves one behind)."""


def gguf_fast_tokenizer(path: str) -> Any:
    """The fast tokenizer of GGUF file ``path``: kept from an earlier conversion, or converted
    (and kept)."""
    # PreTrainedTokenizerFast directly, not AutoTokenizer: both convert the GGUF vocabulary to the
    # same generic fast tokenizer, but AutoTokenizer first builds the model config from the whole
    # file (~4 s for SmolLM2 against ~0.6 s).
    from transformers import PreTrainedTokenizerFast

    entry = _cache_entry(path)
    hf = _load_cached(entry) if entry else None
    if hf is None:
        hf = PreTrainedTokenizerFast.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True
        )
        if entry:
            _store(hf, entry)
    return hf


def _cache_entry(path: str) -> str | None:
    """The cache folder of GGUF file ``path``'s converted tokenizer; None with the cache off."""
    root = os.environ.get(TOKENIZER_CACHE_ENV)
    if root == "0":
        return None
    root = root or os.path.join(os.path.expanduser("~"), ".cache", "kiln", "tokenizers")
    import tokenizers
    import transformers

    real = os.path.realpath(path)
    stat = os.stat(real)
    key = f"{real}\0{stat.st_size}\0{stat.st_mtime_ns}\0{transformers.__version__}\0"
    key += tokenizers.__version__
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return os.path.join(root, f"{os.path.basename(real)}-{digest}")


def _load_cached(entry: str) -> Any:
    """The tokenizer kept in ``entry``, or None (absent, or not loadable: converted again)."""
    if not os.path.isfile(os.path.join(entry, "tokenizer.json")):
        if os.path.isdir(entry):  # an entry someone emptied: in the way of a new one
            shutil.rmtree(entry, ignore_errors=True)
        return None
    from transformers import PreTrainedTokenizerFast

    try:
        hf = PreTrainedTokenizerFast.from_pretrained(entry, local_files_only=True)
        os.utime(entry)  # recently used
        return hf
    except Exception as exc:  # a damaged entry is a miss, never an error
        logger.warning("tokenizer cache %s does not load (%s): converting again", entry, exc)
        shutil.rmtree(entry, ignore_errors=True)
        return None


def _store(hf: Any, entry: str) -> None:
    """Keeps ``hf`` in ``entry``: saved into a folder beside it, then renamed into place, so a
    reader sees a whole entry or none. A cache that cannot be written is skipped."""
    try:
        os.makedirs(os.path.dirname(entry), exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".partial-", dir=os.path.dirname(entry))
    except OSError as exc:
        logger.debug("tokenizer cache not written (%s)", exc)
        return
    try:
        hf.save_pretrained(staging)
        os.rename(staging, entry)
    except OSError as exc:  # another process renamed its copy first, or the disk is full
        logger.debug("tokenizer cache %s not written (%s)", entry, exc)
        shutil.rmtree(staging, ignore_errors=True)
        return
    _evict(os.path.dirname(entry))


def _evict(root: str) -> None:
    """Removes all but the ``TOKENIZER_CACHE_ENTRIES`` most recently used entries of ``root``,
    and what a writer that crashed left there over an hour ago."""
    entries, now = [], time.time()
    try:
        with os.scandir(root) as scan:
            for item in scan:
                mtime = item.stat().st_mtime
                if not item.name.startswith("."):
                    entries.append((mtime, item.path))
                elif item.name.startswith(".partial-") and now - mtime > 3600:
                    shutil.rmtree(item.path, ignore_errors=True)
    except OSError:  # another process removed an entry meanwhile: evict next time
        return
    for _, path in sorted(entries, reverse=True)[TOKENIZER_CACHE_ENTRIES:]:
        shutil.rmtree(path, ignore_errors=True)
