"""TextStream's windowed detokenization against decoding the whole output at every step."""

import random

import pytest
from transformers import AutoTokenizer

from eagle2.bench.prompts import load_suite
from eagle2.target import embedded_model_dir
from eagle2.text import TextStream


class WholeDecode:
    """The reference: the whole output decoded at every step (TextStream before its window)."""

    def __init__(self, tokenizer, stop=()):
        self.tokenizer, self.stop, self.ids, self.emitted = tokenizer, stop, [], ""

    def add(self, ids, final=False):
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cuts = [text.find(s) for s in self.stop if s in text]
        if cuts:
            text, final = text[: min(cuts)], True
        if not final:
            text = text.rstrip("\ufffd")
            for n in range(max([len(s) - 1 for s in self.stop], default=0), 0, -1):
                if any(text.endswith(s[:n]) for s in self.stop if len(s) > n):
                    text = text[:-n]
                    break
        if not text.startswith(self.emitted):
            return ""
        delta, self.emitted = text[len(self.emitted):], text
        return delta


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(embedded_model_dir())


TEXTS = [
    "Größenänderung: 東京タワー 🗼🎉 naïve café — «quotes» ∑ x² ≤ 𝛼; 👩‍👩‍👧 done.",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment ,. ?!\n\n\tprint( x )",
    "A  double  space ,then . odd punctuation ' s n't ... and\n\n\nnewlines.",
] + [p.user_message for p in load_suite("mt_bench", 6) + load_suite("humaneval", 4)]


def _chunks(ids, rng):
    i = 0
    while i < len(ids):
        n = rng.choice([1, 1, 2, 3, 5, 8])
        yield ids[i:i + n], i + n >= len(ids)
        i += n


@pytest.mark.parametrize("stop", [(), ("\n\n",), (" the", "ção", "🎉"), ("return",)])
def test_every_delta_is_whole_decodings(tokenizer, stop):
    """Text that tokenizes normally, including characters split over several tokens, in
    chunks of 1-8 tokens (a step's accepted tokens): every step's delta, the stop, and the
    final text are those of decoding the whole output each step."""
    rng = random.Random(0)
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        ours, ref = TextStream(tokenizer, stop), WholeDecode(tokenizer, stop)
        for chunk, last in _chunks(ids, rng):
            assert ours.add(chunk, final=last) == ref.add(chunk, final=last)
            if ours.stopped:
                break
        assert ours.text == ref.emitted
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        cut = min([whole.find(s) for s in stop if s in whole], default=len(whole))
        assert ours.text == whole[:cut]
        assert ours.stopped == (cut < len(whole))


def test_random_tokens_end_as_their_whole_decoding(tokenizer):
    """Arbitrary token ids (bytes that are no valid text, special tokens): the stream never
    fails and its final text is the whole output's decoding."""
    rng = random.Random(1)
    for _ in range(40):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 120))]
        ours = TextStream(tokenizer)
        for chunk, last in _chunks(ids, rng):
            ours.add(chunk, final=last)
        assert ours.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_each_step_decodes_a_window_not_the_output(tokenizer):
    """The cost of a step does not grow with the output: after the first steps each decode
    call sees the window's tokens, those of a character still split, and the new ones, a
    handful whatever the output's length (the final call decodes all)."""
    seen = []

    class Counting:
        def decode(self, ids, **kw):
            seen.append(len(ids))
            return tokenizer.decode(ids, **kw)

    stream = TextStream(Counting())
    ids = tokenizer(" ".join(TEXTS), add_special_tokens=False)["input_ids"][:400]
    for i in range(0, len(ids), 2):
        stream.add(ids[i:i + 2], final=i + 2 >= len(ids))
    assert max(seen[:-1]) <= 16 and seen[-1] == len(ids)
    assert stream.text == tokenizer.decode(ids, skip_special_tokens=True)
