"""Prompts for the quality evaluation: haystacks from texts Debian ships, and the tasks built on
them. A task is one function in TASKS; a haystack source is one line in SOURCES.

Every prompt is (context, tail): `context` is prefilled and compressed (it ends with the
question, less its last token, so the scoring window sees the question, as in SnapKV's
setting); `tail` is the question's last token followed by the gold answer, teacher-forced over
the compressed cache. Exact match = the argmax equals the gold token at every answer position
(the same as greedy decoding of the answer); the gold log-probability is the sum over the
answer's tokens.

To add a task: write `def my_task(b: Builder) -> Prompt` (b.rng, b.insert, b.key, b.number) and
add it to TASKS. To add a haystack: add (label, source) to SOURCES ("file:PATH", "man:PAGE").
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import random
import re
import subprocess
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

# Haystack candidates: licences, manual pages, changelogs and READMEs (all shipped by Debian on
# these machines; a missing or short one is skipped). Kept varied on purpose: licences alone
# reward recency and repetition.
SOURCES: List[Tuple[str, str]] = [
    ("GPL-3", "file:/usr/share/common-licenses/GPL-3"),
    ("man bash", "man:bash"),
    ("git changelog", "file:/usr/share/doc/git/changelog.gz"),
    ("man find", "man:find"),
    ("Apache-2.0", "file:/usr/share/common-licenses/Apache-2.0"),
    ("man ssh", "man:ssh"),
    ("bash NEWS", "file:/usr/share/doc/bash/NEWS.gz"),
    ("man git", "man:git"),
    ("MPL-2.0", "file:/usr/share/common-licenses/MPL-2.0"),
    ("man systemd", "man:systemd"),
    ("coreutils changelog", "file:/usr/share/doc/coreutils/changelog.gz"),
    ("man cmake", "man:cmake"),
    ("GFDL-1.3", "file:/usr/share/common-licenses/GFDL-1.3"),
    ("man tar", "man:tar"),
    ("bash README", "file:/usr/share/doc/bash/README.gz"),
    ("man gcc", "man:gcc"),
    ("LGPL-2.1", "file:/usr/share/common-licenses/LGPL-2.1"),
    ("man rsync", "man:rsync"),
    ("make NEWS", "file:/usr/share/doc/make/NEWS.gz"),
    ("man gdb", "man:gdb"),
    ("GPL-2", "file:/usr/share/common-licenses/GPL-2"),
    ("man curl", "man:curl"),
    ("apt changelog", "file:/usr/share/doc/apt/changelog.gz"),
    ("man grep", "man:grep"),
    ("man sed", "man:sed"),
    ("Artistic", "file:/usr/share/common-licenses/Artistic"),
    ("man ls", "man:ls"),
    ("man journalctl", "man:journalctl"),
    ("man perl", "man:perlfunc"),
    ("python3 NEWS", "file:/usr/share/doc/python3.11/NEWS.gz"),
    ("man valgrind", "man:valgrind"),
    ("man ip", "man:ip"),
    ("man awk", "man:gawk"),
    ("man less", "man:less"),
    ("MPL-1.1", "file:/usr/share/common-licenses/MPL-1.1"),
    ("man dpkg", "man:dpkg"),
]

# Key words for the retrieval tasks (common, single-token-ish English nouns).
WORDS = ("apple river candle mirror garden engine falcon lantern marble pepper saddle tunnel "
         "violin walnut anchor basket cactus dragon harbor island jacket kettle ladder meadow "
         "napkin orchid parrot quartz rocket silver tiger umbrella velvet window yellow zebra "
         "bridge castle desert forest glacier helmet igloo jungle kitten lemon magnet needle "
         "oyster pencil quiver ribbon spider temple unicorn valley wagon").split()


def read_text(source: str) -> str:
    kind, _, arg = source.partition(":")
    if kind == "file":
        if not os.path.exists(arg):
            return ""
        opener = gzip.open if arg.endswith(".gz") else open
        with opener(arg, "rt", errors="replace") as f:
            text = f.read()
    else:
        env = dict(os.environ, MANWIDTH="80", MAN_KEEP_FORMATTING="", LC_ALL="C.UTF-8")
        try:
            text = subprocess.run(["man", "-P", "cat", arg], capture_output=True, text=True,
                                  env=env, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return ""
    text = re.sub(r"[ \t]+", " ", text)          # man's justification spaces
    text = re.sub(r"\n\s*\n\s*\n+", "\n\n", text)
    return text.strip()


class Corpus:
    """The tokenized haystack sources that exist here and hold at least `min_tokens` tokens."""

    def __init__(self, tok, min_tokens: int, sources: Sequence[Tuple[str, str]] = SOURCES):
        self.texts: List[Tuple[str, torch.Tensor]] = []
        for label, source in sources:
            text = read_text(source)
            if not text:
                continue
            ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
            if ids.shape[0] >= min_tokens:
                self.texts.append((label, ids))
        if not self.texts:
            raise RuntimeError(f"no haystack source with {min_tokens} tokens found")

    def span(self, rng: random.Random, length: int, index: Optional[int] = None
             ) -> Tuple[str, torch.Tensor]:
        """A random contiguous span of `length` tokens from one source (index: which, mod the
        number of sources; random otherwise)."""
        i = rng.randrange(len(self.texts)) if index is None else index % len(self.texts)
        label, ids = self.texts[i]
        start = rng.randrange(ids.shape[0] - length + 1)
        return label, ids[start:start + length]


@dataclasses.dataclass
class Prompt:
    task: str
    source: str          # haystack label
    n: int               # prefilled (compressed) tokens
    context: torch.Tensor
    tail: torch.Tensor   # the question's last token, then the answer
    depths: List[float]  # where the facts were inserted (fraction of the haystack)
    # token spans [start, end) in the context of the facts the answer needs (the gold facts)
    gold_spans: List[Tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def answer(self) -> torch.Tensor:
        return self.tail[1:]


class Builder:
    """Inserts sentences into a haystack at random depths and closes it with a question."""

    def __init__(self, tok, rng: random.Random, corpus: Corpus, length: int, index: int):
        self.tok, self.rng, self.corpus, self.length, self.index = tok, rng, corpus, length, index
        self.facts: List[Tuple[float, List[int], bool]] = []   # depth, tokens, gold
        self._words = rng.sample(WORDS, len(WORDS))
        self._numbers: set = set()

    def encode(self, text: str) -> List[int]:
        return self.tok(text, add_special_tokens=False).input_ids

    def key(self) -> str:
        """A key word not used before in this prompt."""
        return self._words.pop()

    def number(self, digits: int = 6) -> str:
        """A random number not used before in this prompt."""
        while True:
            x = str(self.rng.randrange(10 ** (digits - 1), 10 ** digits))
            if x not in self._numbers:
                self._numbers.add(x)
                return x

    def insert(self, sentence: str, depth: Optional[float] = None,
               between: Tuple[float, float] = (0.05, 0.95), gold: bool = True) -> float:
        """Queue `sentence` at `depth` (random in `between` if not given); returns the depth.
        gold: the answer needs this fact (False for distractors)."""
        if depth is None:
            depth = self.rng.uniform(*between)
        self.facts.append((depth, self.encode("\n" + sentence.strip() + "\n"), gold))
        return depth

    def set_gold(self, which: Sequence[int]) -> None:
        """Only the facts inserted `which`-th (0-based) are gold."""
        self.facts = [(d, f, i in which) for i, (d, f, _) in enumerate(self.facts)]

    def build(self, task: str, question: str, answer: str) -> Prompt:
        """The haystack of `length` tokens in all (facts and question included)."""
        q = self.encode("\n\n" + question)
        a = self.encode(answer)
        body = self.length - len(q) - sum(len(f) for _, f, _ in self.facts)
        if body < self.length // 2:
            raise ValueError(f"{task}: the facts and question leave {body} of {self.length}")
        label, hay = self.corpus.span(self.rng, body, self.index)
        hay = hay.tolist()
        ids: List[int] = []
        last = 0
        spans = []
        for depth, fact, gold in sorted(self.facts, key=lambda f: f[0]):
            cut = max(last, int(body * depth))
            ids += hay[last:cut]
            if gold:
                spans.append((len(ids), len(ids) + len(fact)))
            ids += fact
            last = cut
        ids += hay[last:] + q
        context = torch.tensor(ids[:-1])
        return Prompt(task, label, len(ids) - 1, context, torch.tensor([ids[-1]] + a),
                      sorted(d for d, _, _ in self.facts), spans)


# --------------------------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------------------------

def single_needle(b: Builder) -> Prompt:
    """One pass key in the haystack (the classic needle)."""
    key = b.number(5)
    b.insert(f"The pass key is {key}. Remember it. {key} is the pass key.")
    return b.build("single_needle", "What is the pass key? The pass key is", f" {key}")


def multi_key(b: Builder, distractors: int = 3) -> Prompt:
    """One key's number among `distractors` other keys with numbers of the same form."""
    target, number = b.key(), b.number()
    b.insert(f"The special magic number for {target} is {number}.")
    for _ in range(distractors):
        b.insert(f"The special magic number for {b.key()} is {b.number()}.", gold=False)
    return b.build("multi_key", f"What is the special magic number for {target}? The special "
                   f"magic number for {target} is", f" {number}")


def multi_value(b: Builder, values: int = 3) -> Prompt:
    """One key with several numbers spread over the haystack, asked for in order."""
    target = b.key()
    numbers = [b.number() for _ in range(values)]
    depths = sorted(b.rng.uniform(0.05, 0.95) for _ in range(values))
    for depth, number in zip(depths, numbers):
        b.insert(f"One of the special magic numbers for {target} is {number}.", depth)
    b.insert(f"The special magic number for {b.key()} is {b.number()}.", gold=False)
    return b.build("multi_value", f"What are all the special magic numbers for {target}, in "
                   f"order? The special magic numbers for {target} are",
                   " " + ", ".join(numbers) + ".")


def multi_query(b: Builder, keys: int = 4) -> Prompt:
    """Several keys in the haystack; two of them asked for at once."""
    pairs = [(b.key(), b.number()) for _ in range(keys)]
    for key, number in pairs:
        b.insert(f"The special magic number for {key} is {number}.")
    (k1, n1), (k2, n2) = b.rng.sample(pairs, 2)
    b.set_gold([pairs.index((k1, n1)), pairs.index((k2, n2))])
    return b.build("multi_query", f"What are the special magic numbers for {k1} and {k2}? The "
                   f"special magic numbers for {k1} and {k2} are", f" {n1} and {n2}.")


def variable_tracking(b: Builder, hops: int = 2, chains: int = 2) -> Prompt:
    """A chain of assignments X1 = number, X2 = X1, ... (and distractor chains); asks for the
    last variable's value, which needs every hop."""
    names = [f"{b.key().upper()[:3]}{b.rng.randrange(10, 99)}" for _ in range(chains * (hops + 1))]
    answer = ""
    for c in range(chains):
        chain = names[c * (hops + 1):(c + 1) * (hops + 1)]
        value = b.number(5)
        depths = sorted(b.rng.uniform(0.05, 0.95) for _ in chain)
        b.insert(f"VAR {chain[0]} = {value}", depths[0], gold=c == 0)
        for prev, name, depth in zip(chain, chain[1:], depths[1:]):
            b.insert(f"VAR {name} = VAR {prev}", depth, gold=c == 0)
        if c == 0:
            asked, answer = chain[-1], value
    return b.build("variable_tracking", f"What number does VAR {asked} hold? VAR {asked} holds",
                   f" {answer}")


TASKS: Dict[str, Callable[[Builder], Prompt]] = {
    "single_needle": single_needle,
    "multi_key": multi_key,
    "multi_value": multi_value,
    "multi_query": multi_query,
    "variable_tracking": variable_tracking,
}


def make_prompts(tok, corpus: Corpus, plan: Dict[str, int], lengths: Sequence[int],
                 seed: int) -> List[Prompt]:
    """plan[task] prompts of each task, spread evenly over `lengths` and the corpus's sources,
    with keys, numbers and depths from `seed` (the dev grid and the test run use different
    seeds, so the default is never chosen on the prompts it is reported on)."""
    prompts = []
    for t, (task, count) in enumerate(plan.items()):
        rng = random.Random(f"{seed}/{task}")
        for i in range(count):
            length = lengths[i % len(lengths)]
            b = Builder(tok, rng, corpus, length, index=t * 7 + i)
            prompts.append(TASKS[task](b))
    return prompts


@dataclasses.dataclass
class Document:
    """A language-model sample: n tokens of context, then `cont` tokens to predict."""
    source: str
    n: int
    ids: torch.Tensor   # n + cont tokens


def make_documents(corpus: Corpus, count: int, lengths: Sequence[int], cont: int,
                   seed: int) -> List[Document]:
    """`count` spans, one source each in turn (at most one span per source before any
    repeats), the lengths alternating so that no source is measured at one length only when it
    appears twice."""
    rng = random.Random(f"{seed}/documents")
    docs = []
    for i in range(count):
        n = lengths[(i + i // len(corpus.texts)) % len(lengths)]
        label, ids = corpus.span(rng, n + cont, index=i)
        docs.append(Document(label, n, ids))
    return docs
