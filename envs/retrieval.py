"""Long-document retrieval: find a vault code in a generated haystack with ``search`` and ``read`` tools.

Each task plants a chain of facts (and distractor chains built the same way) in a haystack
(``envs/haystack.py``; length in words ~ tokens, 8K to 1M and beyond):
``P manages the Q project.`` / ``The Q project is based in C.`` / ``The vault code for C is K.``
``hops`` (1..3) is how many of these the question makes the model follow, e.g. for 3 hops: "What is the
vault code for the city where the project managed by P is based?". ``search(query)`` lists matching
documents with the word offset of each match (not the text); ``read(doc_id, offset)`` returns a page of
words. Answer: ``Final answer: K``.

Difficulty presets (override any field by keyword): easy 8K words, 1 hop, 2 distractor chains; medium 64K,
2 hops, 8; hard 1M, 3 hops, 32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from envs.base import ToolEnv, resolve_config
from envs.haystack import FILLER, SENTENCE, STOP, Haystack
from envs.parsing import first_number, format_call
from envs.tools import Tool, ToolError, object_schema

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "th")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "or", "en")
SYSTEM = "Find the answer with the search and read tools, then reply: Final answer: <code>"


@dataclass(frozen=True)
class RetrievalConfig:
    n_tokens: int  # haystack length in words
    hops: int  # facts the question chains (1..3)
    distractors: int  # extra full fact chains about other entities
    words_per_doc: int = 500
    page_words: int = 200  # words returned by one read
    top_k: int = 5  # search results per query
    max_turns: int = 16


PRESETS = {
    "easy": RetrievalConfig(n_tokens=8_000, hops=1, distractors=2),
    "medium": RetrievalConfig(n_tokens=64_000, hops=2, distractors=8),
    "hard": RetrievalConfig(n_tokens=1_000_000, hops=3, distractors=32, max_turns=24),
}


@dataclass(frozen=True)
class Chain:
    person: str
    project: str
    city: str
    code: int

    def sentences(self) -> list[str]:
        return [
            f"{self.person} manages the {self.project} project.",
            f"The {self.project} project is based in {self.city}.",
            f"The vault code for {self.city} is {self.code}.",
        ]


def question(chain: Chain, hops: int) -> str:
    return {
        1: f"What is the vault code for {chain.city}?",
        2: f"What is the vault code for the city where the {chain.project} project is based?",
        3: f"What is the vault code for the city where the project managed by {chain.person} is based?",
    }[hops]


class RetrievalEnv(ToolEnv):
    def __init__(self, difficulty: Literal["easy", "medium", "hard"] = "easy", **overrides: Any) -> None:
        cfg = resolve_config(PRESETS, difficulty, overrides)
        if not 1 <= cfg.hops <= 3 or cfg.distractors < 0 or cfg.page_words < 20 or cfg.top_k < 1:
            raise ValueError(f"invalid retrieval config {cfg}")
        if cfg.words_per_doc < SENTENCE or cfg.n_tokens < cfg.words_per_doc:
            raise ValueError(f"need words_per_doc >= {SENTENCE} and n_tokens >= words_per_doc, got {cfg}")
        room = -(-cfg.n_tokens // cfg.words_per_doc) * (cfg.words_per_doc // SENTENCE + 1)
        if cfg.hops + 3 * cfg.distractors > room:
            raise ValueError(f"{cfg.distractors} distractor chains do not fit in {cfg.n_tokens} words")
        self.config = cfg
        search = Tool(
            name="search",
            description="Keyword search over the documents; lists matching doc ids and word offsets.",
            parameters=object_schema({"query": {"type": "string"}}),
            fn=self._search,
        )
        read = Tool(
            name="read",
            description=f"Read {cfg.page_words} words of a document starting at a word offset.",
            parameters=object_schema(
                {"doc_id": {"type": "integer"}, "offset": {"type": "integer", "minimum": 0}}, required=["doc_id"]
            ),
            fn=self._read,
        )
        super().__init__([search, read], max_turns=cfg.max_turns)

    # -- task ---------------------------------------------------------------------------------------------
    def _name(self, taken: set[str]) -> str:
        while True:
            n = int(self.np_random.integers(2, 4))
            name = "".join(str(self.np_random.choice(_ONSETS)) + str(self.np_random.choice(_VOWELS)) for _ in range(n))
            if name not in taken and name not in FILLER and name not in STOP:
                taken.add(name)
                return name.capitalize()

    def _new_task(self, options: dict[str, Any] | None) -> list[dict[str, str]]:
        cfg, taken = self.config, set()
        chains = [
            Chain(self._name(taken), self._name(taken), self._name(taken), int(self.np_random.integers(1000, 1_000_000)))
            for _ in range(1 + cfg.distractors)
        ]
        self.chain = chains[0]
        # a chain of fewer hops needs only its last facts, but distractors keep all three
        sentences = self.chain.sentences()[3 - cfg.hops:] + [s for c in chains[1:] for s in c.sentences()]
        self.haystack = Haystack(int(self.np_random.integers(2**62)), cfg.n_tokens, cfg.words_per_doc, sentences)
        self._needed = [f for s in self.chain.sentences()[3 - cfg.hops:] for f in self.haystack.facts if f.sentence == s]
        self._located: set[int] = set()  # indices into _needed that a search listed
        self._revealed: set[int] = set()  # indices into _needed that a read showed in full
        n = self.haystack.n_docs
        user = f"There are {n} documents (ids 0-{n - 1}, about {cfg.n_tokens} words). {question(self.chain, cfg.hops)}"
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]

    # -- tools --------------------------------------------------------------------------------------------
    def _search(self, query: str) -> str:
        hits = self.haystack.search(query, self.config.top_k)
        if not hits:
            return "no matches"
        for i, fact in enumerate(self._needed):
            if any(h.fact == fact for h in hits):
                self._located.add(i)
        return "\n".join(f"doc {h.doc_id} ({self.haystack.title(h.doc_id)}): match at word {h.offset}" for h in hits)

    def _read(self, doc_id: int, offset: int = 0) -> str:
        try:
            words = self.haystack.words(doc_id)
        except IndexError as e:
            raise ToolError(str(e)) from None
        if offset >= len(words):
            raise ToolError(f"offset must be below {len(words)} (the length of doc {doc_id})")
        end = min(offset + self.config.page_words, len(words))
        for i, fact in enumerate(self._needed):
            if fact.doc_id == doc_id and offset <= fact.offset and fact.offset + fact.length <= end:
                self._revealed.add(i)
        return f"[doc {doc_id}, words {offset}-{end} of {len(words)}]\n" + " ".join(words[offset:end])

    # -- scoring, oracle ----------------------------------------------------------------------------------
    def _is_correct(self, answer: str) -> bool:
        return first_number(answer) == self.chain.code

    def oracle_action(self) -> str:
        keys = [self.chain.person, self.chain.project, self.chain.city][3 - self.config.hops:]
        for i, fact in enumerate(self._needed):
            if i not in self._revealed:
                if i in self._located:
                    return format_call("read", {"doc_id": fact.doc_id, "offset": fact.offset})
                return format_call("search", {"query": keys[i]})
        return f"Final answer: {self.chain.code}"
