"""Shared fixtures: a small offline text corpus, an isolated data cache, the equivalence matrix's single-process
reference; and whether PyPI is reachable."""

import os
import random
import socket
from pathlib import Path

import pytest

WORDS = ("the king queen lord love death night day sword crown heart blood fair sweet time man woman "
         "good noble speak hear tell come go fly stay answer question honour grace war peace tomorrow "
         "yesterday thou thee thy hath doth art shall will may must never ever more less light dark").split()


def make_corpus(root: Path, n_docs: int = 40, words_per_doc: int = 1500, seed: int = 0) -> Path:
    """Deterministic pseudo-English documents (one .txt per document)."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for d in range(n_docs):
        lines = []
        for _ in range(words_per_doc // 10):
            line = " ".join(rng.choice(WORDS) for _ in range(10))
            lines.append(line[0].upper() + line[1:] + rng.choice(".,;!?"))
        (root / f"doc{d:03d}.txt").write_text("\n".join(lines) + "\n")
    return root


def pypi_reachable() -> bool:
    """Whether a TCP connection to PyPI opens: a test that downloads skips only when it does not (a failed
    download with the network up is a failure)."""
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session", autouse=True)
def isolated_cache(tmp_path_factory):
    """Prepared data of tests goes to a temp cache, unless NANOTITAN_CACHE is set (CI shares it)."""
    if "NANOTITAN_CACHE" not in os.environ:
        os.environ["NANOTITAN_CACHE"] = str(tmp_path_factory.mktemp("nanotitan_cache"))
    yield


@pytest.fixture(scope="session")
def reference(corpus_dir, tmp_path_factory):
    """The equivalence matrix's reference (tests/helpers/equivalence.py): one process accumulating over all B/m = 8
    microbatches. Once per session: five modules hold their rows to it."""
    from tests.helpers.equivalence import one_process

    return one_process(corpus_dir, tmp_path_factory, "ref")
