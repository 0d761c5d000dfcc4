"""Generated English prose: the suite's haystack filler and the `prose` training and evaluation source.

    from kvpop.train.prose import prose_documents, prose_sentences
    docs = prose_documents()                                  # PROSE_DOCUMENTS strings, the same everywhere
    paragraphs = prose_sentences(random.Random(0))            # an endless stream of paragraphs

The text comes from a small seeded grammar (a few hundred words, no digits): long, fluent and cheap,
but repetitive. Document `i` is drawn from its own generator, seeded by `i` alone, so the documents
do not depend on the machine, the Python version or the run's `--seed` (which only picks the held-out
ones, as for every source of `kvpop.train.data`).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator

PROSE_DOCUMENTS = 512
"""Documents of the `prose` source: about 3.3M SmolLM2 tokens in all."""
PROSE_PARAGRAPHS = (16, 128)
"""Paragraphs per `prose` document, drawn uniformly: ~1.5k to ~12k tokens, long-context documents."""

_NOUNS = ("harbor", "lantern", "orchard", "river", "village", "teacher", "farmer", "painter", "bridge", "garden",
          "library", "market", "mountain", "traveler", "kitchen", "meadow", "sailor", "window", "workshop", "forest",
          "letter", "carpenter", "valley", "festival", "island", "cellar", "shepherd", "tower", "fountain", "wagon")
_ADJECTIVES = ("quiet", "old", "narrow", "bright", "distant", "patient", "crowded", "gentle", "stubborn", "early",
               "muddy", "curious", "famous", "humble", "windy", "careful", "golden", "empty", "busy", "ancient")
_VERBS = ("visited", "repaired", "painted", "described", "watched", "remembered", "carried", "followed", "cleaned",
          "measured", "admired", "crossed", "guarded", "opened", "mentioned", "studied", "praised", "built")
_PLACES = ("near the coast", "in the hills", "behind the old mill", "across the square", "along the canal",
           "beside the station", "at the edge of town", "under the bridge", "in the northern district")
_TIMES = ("every morning", "after the storm", "before the harvest", "during the long winter", "on most evenings",
          "late in the autumn", "when the bells rang", "at the end of the week", "in those years")
_NAMES = ("Mara", "Tobin", "Elsa", "Corin", "Linnea", "Oskar", "Greta", "Anselm", "Ida", "Bram", "Sunniva", "Edwin")
_TEMPLATES = (
    "The {adj} {noun} {place} was {verb} by a {adj2} {noun2} {time}.",
    "{name} {verb} the {noun} {time}, and nobody in the {noun2} seemed to mind.",
    "Some people say that the {noun} {place} is more {adj} than the {noun2}.",
    "{time_cap}, {name} walked to the {noun} and {verb} the {adj} {noun2}.",
    "Nobody {verb} the {adj} {noun} {place} until {name} arrived {time}.",
    "A {adj} {noun} is easy to overlook, but the {noun2} {place} {verb} it {time}.",
    "{name} wrote that the {noun2} had been {adj} and {adj2} {time}.",
    "If you follow the road {place}, you will find a {adj} {noun} and a {noun2}.",
)


def prose_sentences(rng: random.Random) -> Iterator[str]:
    """Endless sentences from a small grammar, grouped into paragraphs of 3 to 7 sentences."""
    while True:
        sentences = []
        for _ in range(rng.randint(3, 7)):
            time = rng.choice(_TIMES)
            sentences.append(rng.choice(_TEMPLATES).format(
                adj=rng.choice(_ADJECTIVES), adj2=rng.choice(_ADJECTIVES), noun=rng.choice(_NOUNS),
                noun2=rng.choice(_NOUNS), verb=rng.choice(_VERBS), place=rng.choice(_PLACES),
                time=time, time_cap=time[0].upper() + time[1:], name=rng.choice(_NAMES)))
        yield " ".join(sentences) + "\n\n"


def prose_document(index: int) -> str:
    """Document `index` of the `prose` source: `PROSE_PARAGRAPHS` paragraphs from the generator seeded by `index`."""
    rng = random.Random(f"kvpop prose document {index}")
    paragraphs = prose_sentences(rng)
    count = rng.randint(*PROSE_PARAGRAPHS)
    return "".join(next(paragraphs) for _ in range(count)).rstrip() + "\n"


@functools.lru_cache(maxsize=1)
def prose_documents() -> tuple[str, ...]:
    """The `PROSE_DOCUMENTS` documents of the `prose` source, in index order (~1 s, then cached)."""
    return tuple(prose_document(i) for i in range(PROSE_DOCUMENTS))


__all__ = ["PROSE_DOCUMENTS", "PROSE_PARAGRAPHS", "prose_document", "prose_documents", "prose_sentences"]
