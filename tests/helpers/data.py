"""Data test helpers: distinct pseudo-text documents, and local text files of them."""

import json
import random
from pathlib import Path

WORDS = ("the king queen sword crown night day love death honour blood gentle lord lady heaven "
         "fortune grief mercy tongue heart eye hand soul father mother brother sister thee thou").split()


def make_docs(n_docs: int = 12, words: int = 150, seed: int = 0) -> list[str]:
    """Distinct pseudo-text documents (each opens with its own number)."""
    rng = random.Random(seed)
    return [f"Document {i}.\n" + " ".join(rng.choice(WORDS) for _ in range(words)) + ",\nand so to bed.\n"
            for i in range(n_docs)]


def write_txt(d: Path, docs: list[str]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(docs):
        (d / f"doc_{i:03d}.txt").write_text(text)
    return d


def short_docs(d: Path, n_docs: int = 400, seed: int = 0) -> Path:
    """A corpus of many short documents (1 to 12 words, one .txt each): 16-token windows then pack several, and
    their boundaries fall anywhere, across CP chunks and microbatches too."""
    rng = random.Random(seed)
    return write_txt(d, [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))) for _ in range(n_docs)])


def write_sft(path, n: int = 60, seed: int = 0, long_every: int = 0):
    """n records "Q: a and b? i" -> 1 to 6 words (every `long_every`-th a response of 40 words): prompts and responses
    of uneven lengths, so windows hold uneven counts of targets."""
    rng = random.Random(seed)
    words = "apple banana cherry dog egg fish grape house ice jam kite lemon moon nut orange pear".split()
    with open(path, "w") as f:
        for i in range(n):
            a, b = rng.choice(words), rng.choice(words)
            response = " ".join(rng.choice(words) for _ in range(40)) if long_every and i % long_every == 0 \
                else " ".join([b, "then", a][:rng.randint(1, 3)] + rng.choices(words, k=rng.randint(0, 3)))
            f.write(json.dumps({"prompt": f"Q: {a} and {b}? {i}\nA:", "response": " " + response}) + "\n")
    return path
