"""Long-context tasks generated locally (RULER's taxonomy), deterministic from a seed: `kvpop eval --suite`.

    from kvpop.eval.tasks import TASKS, make_sample, score
    sample = make_sample("passkey", tokenizer, length=2048, depth=0.5, index=0, seed=0, filler="prose")
    correct, found = score(sample, generated_text)

Families and tasks:
- retrieval: `passkey` (one needle), `multikey` (the queried key among distractor keys),
  `multivalue` (every value of one key);
- tracking: `vt` (variable chains `VAR B = VAR A`; name every variable holding a value);
- aggregation: `cwe` (the three most common words of a long list);
- qa: `qa` (one attribute of one person, among biographies of others in a long document).

A prompt is exactly `length` tokens or a few fewer (whole words of filler are added until one more
would not fit), chat template and answer prefix included. `depth` is the share of the haystack's
filler tokens that come before the needle (0 = start, 1 = end). A needle goes only where a
sentence or line of filler ends, and every value and key in it must come out of the tokenizer as
tokens of its own (nothing merged across its edges); answers must appear nowhere outside their
needles. A draft that fails a check is redrawn from the same seeded stream.
"""

from __future__ import annotations

import bisect
import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpop.eval.fillers import Words, check_filler, is_code

FAMILIES = ("retrieval", "tracking", "aggregation", "qa")
ATTEMPTS = 20
"""Drafts tried per sample before giving up (a draft is redrawn when the tokenizer merges a value)."""


@dataclass(frozen=True)
class Needle:
    """A sentence inserted into the haystack at `depth`."""

    text: str
    depth: float
    values: tuple[str, ...] = ()
    """Substrings of `text` (keys, values) that the tokenizer must keep whole at every occurrence."""
    answer: bool = False
    """Whether it carries answers: the answers may appear inside such needles only."""


@dataclass
class Draft:
    """What a task generator returns: the words around the haystack, its needles, the answers."""

    instruction: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    needles: list[Needle] = field(default_factory=list)
    """The first needle is the one placed at the sample's depth; the others at their own depths."""
    wrong: tuple[str, ...] = ()
    """Distractor values: an output naming one of them is wrong, whatever else it says."""
    body: Callable[[int], str] | None = None
    """A haystack of its own (aggregation) as a function of a size, instead of filler with needles."""


@dataclass(frozen=True)
class Sample:
    """One prompt, ready to run: `input_ids` are what the model gets, `answers` what it must say."""

    task: str
    family: str
    length: int
    """The requested prompt length in tokens; `len(input_ids)` is at most this (and only a few below)."""
    depth: float | None
    """The requested depth of the first needle; None for tasks without one (aggregation)."""
    index: int
    text: str
    input_ids: tuple[int, ...]
    answers: tuple[str, ...]
    wrong: tuple[str, ...]
    max_new_tokens: int
    filler: str
    haystack: tuple[int, int]
    """Character span of the haystack (filler and needles) in `text`."""
    needles: tuple[tuple[int, int], ...]
    """Character spans of the needles in `text`, the one at `depth` first."""
    depth_measured: float | None
    """Filler tokens before the first needle over all filler tokens of the haystack."""


@dataclass(frozen=True)
class Task:
    name: str
    family: str
    description: str
    max_new_tokens: int
    """Greedy answer tokens generated (decoding stops earlier at EOS)."""
    draft: Callable[[random.Random, float, Words], Draft]
    uses_depth: bool = True


# --- values ---------------------------------------------------------------------------------------------------------

_COLORS = ("amber", "cobalt", "crimson", "ivory", "jade", "scarlet", "silver", "violet", "ochre", "teal", "copper",
           "indigo", "saffron", "olive", "maroon", "pearl")
_ANIMALS = ("falcon", "otter", "heron", "badger", "lynx", "walrus", "gecko", "marten", "condor", "bison", "ferret",
            "puffin", "jackal", "salmon", "mantis", "tapir")
_FIRST = ("Aldo", "Brigid", "Casimir", "Dagny", "Emeric", "Fenna", "Gustav", "Hedda", "Ivo", "Jorun", "Konrad",
          "Liesel", "Matthias", "Nelda", "Orla", "Pavel", "Rosalind", "Sigrid", "Tamsin", "Ulric")
_LAST = ("Arkwright", "Blackwood", "Castellan", "Dunmore", "Everly", "Fairweather", "Greaves", "Holloway", "Ingram",
         "Jessop", "Kettering", "Lockhart", "Merriweather", "Northcote", "Oakley", "Pendleton")
_PROFESSIONS = ("glassblower", "bookbinder", "cartographer", "locksmith", "beekeeper", "ferryman", "clockmaker",
                "stonemason", "weaver", "tanner", "cooper", "falconer", "printer", "saddler", "potter", "miller",
                "lamplighter", "botanist", "surveyor", "chandler", "thatcher", "wheelwright", "tailor", "brewer")
_SYLLABLES = ("var", "hol", "ten", "bre", "dun", "mar", "kel", "stad", "vik", "ros", "lin", "gard", "thal", "wen")


def _fresh(rng: random.Random, make: Callable[[random.Random], str], taken: set[str]) -> str:
    """A value that neither contains nor is contained in any value taken so far (then taken)."""
    while True:
        v = make(rng)
        if not any(v in t or t in v for t in taken):
            taken.add(v)
            return v


def _number(digits: int) -> Callable[[random.Random], str]:
    return lambda rng: str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def _key(rng: random.Random) -> str:
    return f"{rng.choice(_COLORS)}-{rng.choice(_ANIMALS)}"


def _variable(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(5))


def _town(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


# --- task generators -------------------------------------------------------------------------------------------------


def passkey(rng: random.Random, depth: float, words: Words) -> Draft:
    v = _number(7)(rng)
    return Draft(
        "A pass key is hidden inside a lot of irrelevant text below. Find it and remember it: you will be asked "
        "for it afterwards.",
        "What is the pass key?", "The pass key is", (v,),
        [Needle(f"The pass key is {v}. Remember it. {v} is the pass key.", depth, (v,), answer=True)])


def multikey(rng: random.Random, depth: float, words: Words, keys: int = 4) -> Draft:
    names, values = set(), set()
    pairs = [(_fresh(rng, _key, names), _fresh(rng, _number(7), values)) for _ in range(keys)]
    needles = [Needle(f"The secret code for {k} is {v}.", depth if i == 0 else rng.random(), (k, v), answer=i == 0)
               for i, (k, v) in enumerate(pairs)]
    key, v = pairs[0]
    return Draft(
        "Secret codes for several names are hidden inside a lot of irrelevant text below. Remember them: you will "
        "be asked for one of them afterwards.",
        f"What is the secret code for {key}?", f"The secret code for {key} is", (v,), needles,
        wrong=tuple(v for _, v in pairs[1:]))


def multivalue(rng: random.Random, depth: float, words: Words, values: int = 4) -> Draft:
    key = _key(rng)
    taken: set[str] = set()
    vals = [_fresh(rng, _number(7), taken) for _ in range(values)]
    needles = [Needle(f"One of the secret codes for {key} is {v}.", depth if i == 0 else rng.random(), (key, v),
                      answer=True) for i, v in enumerate(vals)]
    return Draft(
        f"Several secret codes for {key} are hidden inside a lot of irrelevant text below. Remember all of them: "
        "you will be asked for them afterwards.",
        f"What are all the secret codes for {key}? There are {values} of them.",
        f"The secret codes for {key} are", tuple(vals), needles)


def variable_tracking(rng: random.Random, depth: float, words: Words, hops: int = 4) -> Draft:
    names: set[str] = set()
    numbers: set[str] = set()
    chains = []
    for _ in range(2):
        value = _fresh(rng, _number(5), numbers)
        chains.append((value, [_fresh(rng, _variable, names) for _ in range(hops + 1)]))
    needles = []
    for c, (value, chain) in enumerate(chains):
        # the asked chain starts at `depth` and spreads evenly to the end; the distractor at random places
        depths = [depth + (1 - depth) * i / hops for i in range(hops + 1)] if c == 0 else sorted(
            rng.random() for _ in range(hops + 1))
        for i, (name, d) in enumerate(zip(chain, depths)):
            rhs = value if i == 0 else f"VAR {chain[i - 1]}"
            needles.append(Needle(f"VAR {name} = {rhs}.", d, (name, rhs.removeprefix("VAR ")), answer=c == 0))
    value, chain = chains[0]
    return Draft(
        "Variable assignments are hidden inside a lot of irrelevant text below. Keep track of them: you will be "
        "asked which variables hold a value.",
        f"Which variables are assigned the value {value}, directly or through other variables? List all of them.",
        f"The variables assigned the value {value} are:", tuple(chain), needles, wrong=tuple(chains[1][1]))


def common_words(rng: random.Random, depth: float, words: Words, top: int = 3) -> Draft:
    seed = rng.random()
    pool = words.vocabulary(64)
    common = rng.sample(pool, top)

    def body(uncommon: int) -> str:
        # a word appears as often at every size, so the list grows with `uncommon` (the length search needs
        # that); the common words stay clearly the most frequent at every size
        others = [w for w in words.vocabulary(uncommon + len(common)) if w not in common][:uncommon]
        r = random.Random(seed)
        items = [w for w in others for _ in range(r.randint(1, 3))]
        items += common * max(6, -(-uncommon // 10))
        random.Random(f"{seed}/{uncommon}").shuffle(items)
        return "\n".join(items)

    return Draft(
        "Below is a long list of words, one per line. Some words appear much more often than the others.",
        f"Which {top} words appear most often in the list above?", f"The {top} most common words in the list are:",
        tuple(common), body=body)


def qa(rng: random.Random, depth: float, words: Words, people: int = 6) -> Draft:
    names, years, towns, jobs = set(), set(), set(), set()
    bios = [(_fresh(rng, lambda r: f"{r.choice(_FIRST)} {r.choice(_LAST)}", names),
             _fresh(rng, lambda r: str(r.randint(1700, 1999)), years), _fresh(rng, _town, towns),
             _fresh(rng, lambda r: r.choice(_PROFESSIONS), jobs)) for _ in range(people)]
    needles = [Needle(f"{n}, a {j} by trade, was born in {y} in the town of {t}.",
                      depth if i == 0 else rng.random(), (n, y, t, j), answer=i == 0) for i, (n, y, t, j) in
               enumerate(bios)]
    ask = rng.randrange(3)
    name = bios[0][0]
    question, prefix = (
        (f"In which year was {name} born?", f"{name} was born in the year"),
        (f"In which town was {name} born?", f"{name} was born in the town of"),
        (f"What was the profession of {name}?", f"{name} worked as a"),
    )[ask]
    return Draft(
        "Below is a long document. Short biographies of several people are scattered through unrelated text. "
        "Read it and answer the question that follows.",
        question, prefix, (bios[0][1 + ask],), needles, wrong=tuple(b[1 + ask] for b in bios[1:]))


TASKS: dict[str, Task] = {t.name: t for t in (
    Task("passkey", "retrieval", "one pass key at the given depth", 16, passkey),
    Task("multikey", "retrieval", "the code of one key among 3 distractor keys", 16, multikey),
    Task("multivalue", "retrieval", "all 4 codes of one key", 48, multivalue),
    Task("vt", "tracking", "every variable of a 4-hop assignment chain (plus a distractor chain)", 48,
         variable_tracking),
    Task("cwe", "aggregation", "the 3 most common words of a long list", 24, common_words, uses_depth=False),
    Task("qa", "qa", "one fact about one person among 6 biographies in a long document", 16, qa),
)}


def parse_tasks(spec: str) -> list[str]:
    """`passkey,vt` or `all` -> task names, checked against `TASKS`."""
    names = list(TASKS) if spec.strip() == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in TASKS]
    if unknown or not names:
        raise ValueError(f"unknown task {', '.join(map(repr, unknown)) or repr(spec)}: choose from "
                         f"{', '.join(TASKS)} (comma-separated), or all")
    return list(dict.fromkeys(names))


# --- scoring ---------------------------------------------------------------------------------------------------------


def answer_pattern(answer: str) -> re.Pattern:
    """Where `answer` counts as said: a number not inside a longer number; a word (case-insensitive) not inside a word."""
    if answer.isdigit():
        return re.compile(rf"(?<!\d){answer}(?!\d)")
    return re.compile(rf"(?<![A-Za-z0-9_]){re.escape(answer)}(?![A-Za-z0-9_])", re.IGNORECASE)


def score(sample: Sample, output: str) -> tuple[bool, float]:
    """(correct, share of the answers found): correct needs every answer and no distractor value."""
    found = sum(bool(answer_pattern(a).search(output)) for a in sample.answers)
    wrong = any(answer_pattern(w).search(output) for w in sample.wrong)
    return found == len(sample.answers) and not wrong, found / len(sample.answers)


# --- assembly --------------------------------------------------------------------------------------------------------


class _Redraw(Exception):
    """The draft failed a check (a value merged by the tokenizer, an answer echoed by the filler)."""


def render(tokenizer, user: str, answer_prefix: str) -> tuple[str, bool]:
    """The prompt text (the chat template's user turn + the answer prefix), and whether to add special tokens."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                             add_generation_prompt=True)
        return text + answer_prefix, False
    return f"{user}\n\nAnswer: {answer_prefix}", True


def _encode(tokenizer, text: str, special: bool, offsets: bool = False):
    return tokenizer(text, add_special_tokens=special, return_offsets_mapping=offsets)


def token_counts(tokenizer, words: Words, n: int) -> list[int]:
    """`c[i]`: tokens of the filler's text before word `i` (i = 0..n), from one tokenisation of its first n words."""
    text = "".join(words.words[:n])
    starts = [s for s, _ in _encode(tokenizer, text, False, offsets=True)["offset_mapping"]]
    c, pos = [], 0
    for w in words.words[:n]:
        c.append(bisect.bisect_left(starts, pos))
        pos += len(w)
    return [*c, len(starts)]


def haystack(words: Words, n: int, counts: list[int], needles: list[Needle],
             code: bool) -> tuple[str, list[tuple[int, int]]]:
    """The first `n` filler words with each needle at the sentence or line end nearest its depth (in tokens).

    Returns the text and each needle's character span in it, in the order of `needles`.
    """
    bounds = [0, *(i + 1 for i in range(n - 1) if words.ends[i]), n]
    at = []
    for j, needle in enumerate(needles):
        want = needle.depth * counts[n]
        k = bisect.bisect_left([counts[b] for b in bounds], want)
        near = min(bounds[max(0, k - 1): k + 1], key=lambda b: abs(counts[b] - want))
        at.append((near, j))
    out, spans, prev = "", [None] * len(needles), 0
    sep = "\n" if code else " "
    for b, j in sorted(at):
        out += "".join(words.words[prev:b])
        prev = b
        text = needles[j].text
        if not out:
            spans[j] = (0, len(text))
            out = text + sep
        elif b == n:
            out = out.rstrip() + "\n"
            spans[j] = (len(out), len(out) + len(text))
            out += text
        elif "\n" in out[len(out.rstrip()):]:
            # a line ends here: the needle takes a line of its own, the next line keeps its indentation
            cut = out.rindex("\n") + 1
            head, tail = out[:cut], out[cut:]
            spans[j] = (len(head), len(head) + len(text))
            out = head + text + "\n" + tail
        else:
            spans[j] = (len(out), len(out) + len(text))
            out += text + " "
    out += "".join(words.words[prev:n])
    return out, spans


def _fit(measure: Callable[[int], int], limit: int, propose: Callable[[int, int], int]) -> int:
    """A size `n` with `measure(n) <= limit` that `propose` sees no room to grow, for a non-decreasing `measure`
    with `measure(0) <= limit`.

    `propose(n, t)` predicts the largest size whose measure stays within `limit`, given `t = measure(n)`;
    a good prediction (the filler's own token counts) needs two or three measures, each a full
    tokenisation of the prompt. A prediction outside the bracket found so far is replaced by bisection.
    """
    lo, hi = 0, None
    n = propose(0, measure(0))
    for _ in range(100):
        if n <= lo or (hi is not None and n >= hi):
            return lo
        t = measure(n)
        if t <= limit:
            lo = n
        else:
            hi = n
        nxt = propose(n, t)
        if hi is not None and not lo <= nxt < hi:
            nxt = (lo + hi) // 2
        n = nxt
    raise RuntimeError(f"could not fit a prompt to {limit} tokens")


def isolated(text: str, offsets, start: int, end: int) -> bool:
    """Whether the tokens covering `text[start:end]` cover nothing else but whitespace before it."""
    # tokens are in text order: look only near the span (special tokens may have empty offsets)
    i = max(0, bisect.bisect_left(offsets, (start, start)) - 8)
    cover = []
    for s, e in offsets[i:]:
        if s >= end and e > s:
            break
        if s < end and e > start and e > s:
            cover.append((s, e))
    if not cover:
        return False
    first, last = cover[0][0], max(e for _, e in cover)
    return last <= end and (first >= start or not text[first:start].strip())


def _span_tokens(offsets, span: tuple[int, int]) -> int:
    return sum(1 for s, e in offsets if s < span[1] and e > span[0] and e > s)


def _assemble(task: Task, draft: Draft, tokenizer, length: int, words: Words, filler: str, index: int,
              depth: float | None) -> Sample:
    head = f"{draft.instruction}\n\n"
    tail = f"\n\n{draft.question}"
    code = is_code(filler)
    memo: dict[int, tuple[str, list, str, bool]] = {}

    def build(n: int):
        if n not in memo:
            if draft.body is not None:
                hay, spans = draft.body(n), []
            else:
                words.extend_to(n)
                hay, spans = haystack(words, n, counts(n), draft.needles, code)
            text, special = render(tokenizer, head + hay.rstrip() + tail, draft.answer_prefix)
            memo[n] = (hay.rstrip(), spans, text, special)
        return memo[n]

    cache: list[list[int]] = [[0]]

    def counts(n: int) -> list[int]:
        if len(cache[0]) <= n:
            words.extend_to(n + n // 4)
            cache[0] = token_counts(tokenizer, words, n + n // 4)
        return cache[0]

    def measure(n: int) -> int:
        _, _, text, special = build(n)
        return len(_encode(tokenizer, text, special)["input_ids"])

    floor = measure(0)
    if floor > length:
        raise ValueError(f"length {length} is too short for task {task.name!r}: its instruction, question and "
                         f"needles alone take {floor} tokens with this tokenizer")

    def propose(n: int, t: int) -> int:
        if draft.body is not None:
            # the list's tokens grow about linearly with its size
            rate = (t - floor) / n if n else 4.0
            return n + int((length - t) // max(rate, 1e-3))
        # the filler's own token counts: the words that add (or remove) `length - t` tokens
        c = counts(n)
        while c[-1] - c[n] < length - t:
            # more words: as many as the tokens per word seen so far say are needed, and some
            per_word = max(c[-1], 1) / max(len(c) - 1, 1)
            c = counts(max(n + int(1.1 * (length - t) / per_word) + 64, 256))
        return bisect.bisect_right(c, c[n] + length - t) - 1

    n = _fit(measure, length, propose)
    hay, spans, text, special = build(n)
    enc = _encode(tokenizer, text, special, offsets=True)
    offsets = enc["offset_mapping"]
    h0 = text.find(hay)
    if h0 < 0:
        raise ValueError("the chat template changed the prompt's text; the suite needs it verbatim")
    spans = [(h0 + s, h0 + e) for s, e in spans]
    for needle, (s, _) in zip(draft.needles, spans):
        for value in needle.values:
            for m in re.finditer(re.escape(value), needle.text):
                if not isolated(text, offsets, s + m.start(), s + m.end()):
                    raise _Redraw
    if draft.body is None:
        answer_spans = [sp for nd, sp in zip(draft.needles, spans) if nd.answer]
        for a in draft.answers:
            hits = [m.start() for m in answer_pattern(a).finditer(text)]
            if not hits or any(not any(s <= h < e for s, e in answer_spans) for h in hits):
                raise _Redraw
    else:
        for a in draft.answers:
            m = answer_pattern(a).search(hay)
            if m is None or not isolated(text, offsets, h0 + m.start(), h0 + m.end()):
                raise _Redraw
    measured = None
    if spans:
        hay_tokens = [i for i, (s, e) in enumerate(offsets) if e > h0 and s < h0 + len(hay) and e > s]
        needle_tokens = [_span_tokens(offsets, sp) for sp in spans]
        filler_total = len(hay_tokens) - sum(needle_tokens)
        start = spans[0][0]
        before = sum(1 for i in hay_tokens if offsets[i][1] <= start)
        before -= sum(t for sp, t in zip(spans, needle_tokens) if sp[1] <= start)
        measured = before / max(1, filler_total)
    return Sample(task.name, task.family, length, depth, index, text, tuple(enc["input_ids"]), draft.answers,
                  draft.wrong, task.max_new_tokens, filler, (h0, h0 + len(hay)), tuple(spans), measured)


def check_depth(depth: float) -> None:
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth {depth} is outside [0, 1]: a depth is the share of the haystack before the needle "
                         "(0 = start, 1 = end; 0.5, not 50)")


def make_sample(task: str, tokenizer, length: int, depth: float | None, index: int = 0, seed: int = 0,
                filler: str = "prose") -> Sample:
    """Sample `index` of (task, length, depth): the same arguments always give the same prompt.

    Args:
        task: a key of `TASKS`.
        tokenizer: a fast Hugging Face tokenizer (character offsets are needed); its chat template is used.
        length: prompt tokens, template included.
        depth: in [0, 1]; ignored (use None) for tasks without a depth.
        filler: a name of `kvpop.eval.fillers.FILLERS` or a local file or directory.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: choose from {', '.join(TASKS)}")
    spec = TASKS[task]
    check_filler(filler)
    if spec.uses_depth:
        if depth is None:
            raise ValueError(f"task {task!r} needs a depth in [0, 1]")
        check_depth(depth)
    else:
        depth = None
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("the suite needs a fast tokenizer (character offsets), got "
                         f"{type(tokenizer).__name__}")
    rng = random.Random(f"{seed}/{task}/{length}/{depth}/{index}")
    for _ in range(ATTEMPTS):
        words = Words(filler, random.Random(rng.random()))
        draft = spec.draft(rng, 0.0 if depth is None else depth, words)
        try:
            return _assemble(spec, draft, tokenizer, length, words, filler, index, depth)
        except _Redraw:
            continue
    raise ValueError(f"task {task!r}: no draft in {ATTEMPTS} kept every value whole under this tokenizer "
                     f"(or the filler {filler!r} kept echoing an answer)")


__all__ = ["FAMILIES", "TASKS", "Draft", "Needle", "Sample", "Task", "answer_pattern", "check_depth", "haystack",
           "isolated", "make_sample", "parse_tasks", "render", "score", "token_counts"]
