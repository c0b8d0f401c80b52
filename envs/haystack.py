"""A lazily generated document collection ("haystack") with a few planted fact sentences.

Length is counted in words, the approximation of tokens used throughout (real BPE tokenizers give roughly
1.3 tokens per English word). Nothing is materialised: document ``i`` is regenerated on demand from
``(seed, i)`` (filler words drawn from a fixed vocabulary, a period every 12 words), and only the planted
facts (a handful of sentences with their positions) are stored. So a 1M-word haystack "builds" in
microseconds and streams document by document in well under a second, in constant memory.

Search is an inverted index over the planted fact sentences only (filler text is not indexed): a document
matches when a query word (case-insensitive, stop words ignored) occurs in one of its fact sentences.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

FILLER = (
    "the a of and to in is was that it for on with as by at from this which but not are or his her they be "
    "had have one all were there when their an been has more if will would so what about out up into than "
    "them can only other new some time could these two may then first any like now my such over our even "
    "most after also made many before must through back years where much your way well down should because "
    "each just those people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old year off come "
    "since against go came right used take three river mill stone garden window letter market harbor lamp "
    "bridge winter summer morning evening road field forest hill valley lake story music table chair paper "
    "light water fire wind cloud rain snow green blue quiet bright slow early late small large open close"
).split()
STOP = frozenset("the a an of and to in is for on what which where who by at with that this".split())
SENTENCE = 12  # filler words per sentence
_WORD = re.compile(r"[a-z0-9]+")


def words_of(text: str) -> set[str]:
    return set(_WORD.findall(text.lower())) - STOP


@dataclass(frozen=True)
class Fact:
    doc_id: int
    offset: int  # word index of the sentence's first word in the document
    sentence: str

    @property
    def length(self) -> int:
        return len(self.sentence.split())


@dataclass(frozen=True)
class SearchHit:
    doc_id: int
    offset: int
    score: int
    fact: Fact


class Haystack:
    def __init__(self, seed: int, n_words: int, words_per_doc: int, sentences: list[str]) -> None:
        """Plant ``sentences`` at random sentence boundaries of random documents (determined by ``seed``)."""
        if words_per_doc < SENTENCE or n_words < words_per_doc:
            raise ValueError(f"need words_per_doc >= {SENTENCE} and n_words >= words_per_doc")
        self.seed, self.words_per_doc = seed, words_per_doc
        self.n_docs = -(-n_words // words_per_doc)
        rng = random.Random(f"haystack/{seed}")
        slots = words_per_doc // SENTENCE + 1
        places = sorted(rng.sample(range(self.n_docs * slots), len(sentences)))  # distinct (doc, boundary)
        order = rng.sample(range(len(sentences)), len(sentences))  # which sentence goes where
        self._facts: dict[int, list[tuple[int, str]]] = {}  # doc -> [(filler index, sentence)] sorted
        for place, j in zip(places, order):
            self._facts.setdefault(place // slots, []).append(((place % slots) * SENTENCE, sentences[j]))
        self.facts: list[Fact] = []
        for doc_id, planted in self._facts.items():
            shift = 0
            for filler_index, sentence in planted:
                self.facts.append(Fact(doc_id, filler_index + shift, sentence))
                shift += len(sentence.split())
        self._index: dict[str, list[Fact]] = {}
        for fact in self.facts:
            for w in words_of(fact.sentence):
                self._index.setdefault(w, []).append(fact)

    def _rng(self, doc_id: int) -> random.Random:
        return random.Random(f"doc/{self.seed}/{doc_id}")

    def title(self, doc_id: int) -> str:
        return " ".join(self._rng(doc_id).choices(FILLER, k=3)).capitalize()

    def words(self, doc_id: int) -> list[str]:
        """The words of document ``doc_id`` (regenerated each call)."""
        if not 0 <= doc_id < self.n_docs:
            raise IndexError(f"doc_id must be in 0..{self.n_docs - 1}, got {doc_id}")
        rng = self._rng(doc_id)
        rng.choices(FILLER, k=3)  # the title's draws
        filler = rng.choices(FILLER, k=self.words_per_doc)
        for j in range(SENTENCE - 1, len(filler), SENTENCE):
            filler[j] += "."
        out, prev = [], 0
        for filler_index, sentence in self._facts.get(doc_id, []):
            out += filler[prev:filler_index]
            out += sentence.split()
            prev = filler_index
        out += filler[prev:]
        return out

    def iter_docs(self) -> Iterator[tuple[int, str, list[str]]]:
        """Stream ``(doc_id, title, words)`` one document at a time."""
        for doc_id in range(self.n_docs):
            yield doc_id, self.title(doc_id), self.words(doc_id)

    def search(self, query: str, k: int) -> list[SearchHit]:
        """Up to ``k`` fact sentences sharing the most query words (ties: by document, then offset)."""
        scores: dict[Fact, int] = {}
        for w in words_of(query):
            for fact in self._index.get(w, ()):
                scores[fact] = scores.get(fact, 0) + 1
        ranked = sorted(scores.items(), key=lambda fs: (-fs[1], fs[0].doc_id, fs[0].offset))
        return [SearchHit(f.doc_id, f.offset, s, f) for f, s in ranked[:k]]
