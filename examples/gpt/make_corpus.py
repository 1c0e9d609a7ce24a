"""Generate the demo's character-level corpus from a small grammar with a fixed seed.

Why a grammar and not a downloaded book: the machines this runs on reach no data hub, and a
grammar gives structure a tiny model can visibly learn in about a minute of CPU time:
spelling (a closed word list), agreement (singular subjects take "chases", plural "chase"),
copying across a sentence (the question repeats the place named before it), counting and
small sums. The loss falls well below the unigram entropy only if the model learns these.

Run from anywhere:  python examples/gpt/make_corpus.py  (rewrites data/corpus.txt, same bytes
every time for the same --seed and --chars).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

DEFAULT_PATH = Path(__file__).resolve().parent / "data" / "corpus.txt"
DEFAULT_SEED = 1234
DEFAULT_CHARS = 300_000

# (singular, plural) so the generator can enforce subject-verb agreement.
NOUNS: tuple[tuple[str, str], ...] = (
    ("cat", "cats"),
    ("dog", "dogs"),
    ("bird", "birds"),
    ("fox", "foxes"),
    ("child", "children"),
    ("farmer", "farmers"),
    ("robot", "robots"),
    ("teacher", "teachers"),
    ("mouse", "mice"),
    ("horse", "horses"),
)
# (third-person singular, plural / base form)
VERBS: tuple[tuple[str, str], ...] = (
    ("chases", "chase"),
    ("sees", "see"),
    ("likes", "like"),
    ("follows", "follow"),
    ("watches", "watch"),
    ("helps", "help"),
    ("finds", "find"),
)
ADJECTIVES: tuple[str, ...] = ("old", "small", "happy", "quiet", "brown", "clever", "tired", "young")
PLACES: tuple[str, ...] = ("garden", "kitchen", "forest", "barn", "river", "market", "school", "field")
NUMBER_WORDS: tuple[str, ...] = (
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
)


def _noun_phrase(rng: random.Random) -> tuple[str, bool]:
    """Return a noun phrase and whether it is plural (the verb must agree with it)."""
    singular, plural = rng.choice(NOUNS)
    is_plural = rng.random() < 0.5
    noun = plural if is_plural else singular
    det = "the" if is_plural or rng.random() < 0.6 else "a"
    if rng.random() < 0.5:
        return f"{det} {rng.choice(ADJECTIVES)} {noun}", is_plural
    return f"{det} {noun}", is_plural


def _agreement(rng: random.Random) -> str:
    subject, is_plural = _noun_phrase(rng)
    verb_sg, verb_pl = rng.choice(VERBS)
    obj, _ = _noun_phrase(rng)
    return f"{subject} {verb_pl if is_plural else verb_sg} {obj}."


def _where(rng: random.Random) -> str:
    # The answer repeats a place named earlier in the line: learnable only by attending back.
    singular, _ = rng.choice(NOUNS)
    place = rng.choice(PLACES)
    return f"the {singular} is in the {place}. where is the {singular}? in the {place}."


def _count(rng: random.Random) -> str:
    start = rng.randrange(0, len(NUMBER_WORDS) - 4)
    length = rng.randrange(3, min(6, len(NUMBER_WORDS) - start) + 1)
    return "count: " + " ".join(NUMBER_WORDS[start : start + length]) + "."


def _sum(rng: random.Random) -> str:
    a = rng.randrange(0, 7)
    b = rng.randrange(0, 7)
    return f"{NUMBER_WORDS[a]} plus {NUMBER_WORDS[b]} is {NUMBER_WORDS[a + b]}."


_SENTENCE_KINDS = (_agreement, _agreement, _where, _count, _sum)


def generate(num_chars: int = DEFAULT_CHARS, seed: int = DEFAULT_SEED) -> str:
    """Return at least ``num_chars`` characters of text; same output for the same arguments."""
    rng = random.Random(seed)
    lines: list[str] = []
    total = 0
    while total < num_chars:
        sentences = [rng.choice(_SENTENCE_KINDS)(rng) for _ in range(rng.randrange(2, 5))]
        line = " ".join(sentences) + "\n"
        lines.append(line)
        total += len(line)
    return "".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_PATH)
    parser.add_argument("--chars", type=int, default=DEFAULT_CHARS)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args()
    text = generate(args.chars, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {len(text):,} characters, {len(set(text))} distinct, to {args.out}")


if __name__ == "__main__":
    main()
