"""Synthetic prompts of a fixed token length for serving benchmarks.

Contract: ``make_prompts`` returns ``num_prompts`` distinct texts of random common English words,
seeded, each close to ``input_len`` tokens of the served model. When the server can count tokens
(``count_tokens`` is given, e.g. backed by ``POST /tokenize``) each prompt is trimmed or extended
until it has exactly ``input_len`` tokens where words allow it; otherwise a word stands for one
token (true of nearly all of these words, with their leading space, in BPE vocabularies).

Words rather than random token ids: random ids decode to text that re-tokenizes to a different
length and often to invalid UTF-8, and real prompts are words.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

# Frequent, short English words: one BPE token each (with a leading space) in common vocabularies.
WORDS = tuple(
    """the of and to in is it you that he was for on are with as his they be at one have this
    from or had by word but what some we can out other were all there when up use your how said an
    each she which do their time if will way about many then them write would like so these her
    long make thing see him two has look more day could go come did number sound no most people my
    over know water than call first who may down side been now find any new work part take get
    place made live where after back little only round man year came show every good me give our
    under name very through just form great think say help low line differ turn cause much mean
    before move right boy old too same tell does set three want air well also play small end put
    home read hand port large spell add even land here must big high such follow act why ask men
    change went light kind off need house picture try us again animal point mother world near build
    self earth father head stand own page should country found answer school grow study still learn
    plant cover food sun four between state keep eye never last let thought city tree cross farm
    hard start might story saw far sea draw left late run while press close night real life few
    north open seem together next white children begin got walk example ease paper group always
    music those both mark often letter until mile river car feet care second book carry took
    science eat room friend began idea fish mountain stop once base hear horse cut sure watch color
    face wood main enough plain girl usual young ready above ever red list though feel talk bird
    soon body dog family direct pose leave song measure door product black short numeral class
    wind question happen complete ship area half rock order fire south problem piece told knew pass
    since top whole king space heard best hour better true during hundred five remember step early
    hold west ground interest reach fast verb sing listen six table travel less morning ten simple
    several vowel toward war lay against pattern slow center love person money serve appear road
    map rain rule govern pull cold notice voice unit power town fine certain fly fall lead cry dark
    machine note wait plan figure star box noun field rest correct able pound done beauty drive
    stood contain front teach week final gave green quick develop ocean warm free minute strong
    special mind behind clear tail produce fact street inch multiply nothing course stay wheel full
    force blue object decide surface deep moon island foot system busy test record boat common gold
    possible plane stead dry wonder laugh thousand ago ran check game shape equate hot miss brought
    heat snow tire bring yes distant fill east paint language among""".split()
)

SHORT_WORDS = tuple(w for w in WORDS if len(w) <= 3)

CountTokens = Callable[[str], Awaitable[int | None]]
"""Returns the number of tokens the server makes of a text, or None when it cannot tell."""

MAX_CALIBRATION_ROUNDS = 8


@dataclass(frozen=True)
class Prompt:
    text: str
    num_tokens: int
    """Tokens counted by the server, or the estimate (one per word) when it could not count."""
    is_calibrated: bool


async def _calibrate(
    words: list[str], target: int, rng: random.Random, count_tokens: CountTokens
) -> Prompt:
    """Add or drop words until the server counts ``target`` tokens (or the closest it got)."""
    best: tuple[int, list[str]] | None = None
    for _ in range(MAX_CALIBRATION_ROUNDS):
        count = await count_tokens(" ".join(words))
        if count is None:
            return Prompt(" ".join(words), len(words), is_calibrated=False)
        if best is None or abs(count - target) < abs(best[0] - target):
            best = (count, list(words))
        if count == target:
            break
        if count < target:
            # Close to the target, pad with the shortest words: one token each in any vocabulary.
            pool = WORDS if target - count > 4 else SHORT_WORDS
            words = words + rng.choices(pool, k=target - count)
        else:
            # Words can be several tokens: drop at least one, and never the last one.
            words = words[: max(1, len(words) - max(1, (count - target) // 2))]
    assert best is not None
    return Prompt(" ".join(best[1]), best[0], is_calibrated=True)


async def make_prompts(
    num_prompts: int,
    input_len: int,
    seed: int = 0,
    count_tokens: CountTokens | None = None,
    max_parallel: int = 8,
) -> list[Prompt]:
    """``num_prompts`` random prompts of about ``input_len`` tokens each.

    Args:
        count_tokens: the server's token counter; None to estimate one token per word.
        max_parallel: most ``count_tokens`` calls in flight at once.

    Raises:
        ValueError: ``num_prompts`` or ``input_len`` below 1.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts!r}")
    if input_len < 1:
        raise ValueError(f"input_len must be >= 1, got {input_len!r}")
    rng = random.Random(seed)
    # Each prompt's words come from its own generator, so prompt i is the same whatever the others.
    drafts = [
        (rng.choices(WORDS, k=input_len), random.Random(rng.random())) for _ in range(num_prompts)
    ]
    if count_tokens is None:
        return [Prompt(" ".join(words), len(words), False) for words, _ in drafts]
    limit = asyncio.Semaphore(max_parallel)

    async def one(words: list[str], prompt_rng: random.Random) -> Prompt:
        async with limit:
            return await _calibrate(words, input_len, prompt_rng, count_tokens)

    return list(await asyncio.gather(*(one(w, r) for w, r in drafts)))
