"""Long-range recall: a random word list, a long stretch of unrelated text, then the list again, copied.

Errors on distant tokens may never show in perplexity or in a 32-token entropy window, and the pass key
(:mod:`.passkey`) is at the floor for small models even in FP16. Copying a list seen long before is what
small models *can* do (induction heads), so this task measures whether the quantized cache still lets the
model read a stretch of tokens far back, word for word.

A trial is, in tokens (no chat template: a plain text continuation)::

    [BOS] "List of words:" w1 .. wN "\\n\\n" <D filler tokens> "\\n\\nList of words:" w1 .. wN

- the words: ``N`` distinct words drawn with a seeded RNG from a pool of the :data:`POOL_SIZE` most frequent
  lower-case words (at least :data:`MIN_LETTERS` letters) of the ``prose`` **eval** split, each a single token
  when written with a leading space (``" river"``), so every word of the list is exactly one token;
- the filler: ``D`` consecutive tokens of the ``long`` **eval** split (Shakespeare, as the pass key uses), from
  a seeded offset, so trials are not one prompt repeated. ``D`` (the *distance*) counts the filler tokens
  only; a copied word's first occurrence lies ``D + N`` plus the separator's and the cue's tokens back
  (:attr:`Trial.gap`);
- the cue: the list's header again, after a blank line.

Scoring (teacher forcing, the pass-key convention): everything before the repeat's first word is prefilled in
one pass; then the repeat's tokens are fed one at a time through the method's decoder (cache or live session),
so every scored prediction reads the stored (quantized) past, as decoding would. The tokens that count are the
repeat's words 2 .. N (``N - 1`` tokens): each is predicted from the words copied so far, and only the first
list, ``gap`` tokens back, says which word comes next. The first word of the repeat is not scored: after the
cue the model may as well start prose as a copy, and that choice is not what the task measures. Per method and
distance: top-1 accuracy and mean NLL (nats) over the counted tokens of all trials.
"""

from __future__ import annotations

import functools
import random
import re
from collections import Counter
from dataclasses import asdict, dataclass

import torch

from kvguard import data

HEADER = "List of words:"
SEPARATOR = "\n\n"
WORDS_CORPUS = "prose"  # Wikipedia openings: everyday vocabulary
FILLER_CORPUS = "long"  # Shakespeare: long unrelated text, as the pass key's filler
POOL_SIZE = 512
MIN_LETTERS = 4  # shorter words are mostly function words ("the", "and") the model guesses from grammar
DEFAULT_WORDS = 20
OFFSETS = 4096  # filler start offsets a seed chooses from
_WORD = re.compile(r"[a-z]+")


@dataclass(frozen=True)
class Trial:
    """One prompt: ``ids`` ``[T]``; the first list's first word at ``first``, the repeat's at ``repeat``
    (``ids[first:first + N] == ids[repeat:repeat + N]``); ``distance`` filler tokens in between."""

    ids: torch.Tensor
    words: tuple[str, ...]
    first: int
    repeat: int
    distance: int

    @property
    def gap(self) -> int:
        """How far back each copied word's first occurrence is (tokens)."""
        return self.repeat - self.first

    @property
    def targets(self) -> torch.Tensor:
        """The counted tokens ``[N - 1]``: the repeat's words 2 .. N."""
        return self.ids[self.repeat + 1:self.repeat + len(self.words)]


@dataclass(frozen=True)
class CopyScore:
    """Scores of the counted tokens of one trial: how many, how many were the arg-max, their summed NLL."""

    tokens: int
    correct: int
    nll_sum: float


@dataclass(frozen=True)
class RecallResult:
    """One method at one distance over ``trials`` prompts: ``top1`` and ``nll`` (mean, nats) over all
    ``tokens`` counted tokens; ``trial_top1`` per trial, to see the spread."""

    method: str
    distance: int
    words: int
    trials: int
    tokens: int
    top1: float
    nll: float
    trial_top1: tuple[float, ...]

    def to_json(self) -> dict:
        return asdict(self)


def score_copy(logits: torch.Tensor, targets: torch.Tensor) -> CopyScore:
    """Top-1 hits and summed NLL of ``targets`` ``[N]`` under next-token ``logits`` ``[N, vocab]``."""
    if logits.dim() != 2 or logits.shape[0] != targets.numel():
        raise ValueError(f"need logits [N, vocab] for N = {targets.numel()} targets, got {tuple(logits.shape)}")
    targets = targets.to(logits.device)
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, vocab]
    nll = -logp.gather(1, targets.view(-1, 1)).sum().item()
    correct = int((logits.argmax(dim=-1) == targets).sum().item())
    return CopyScore(targets.numel(), correct, nll)


@functools.lru_cache(maxsize=4)
def word_pool(tokenizer) -> tuple[int, ...]:
    """Token ids of the :data:`POOL_SIZE` most frequent eval-split words that are one token each."""
    counts = Counter(w for doc in data.documents(WORDS_CORPUS, data.Split.EVAL)
                     for w in _WORD.findall(doc.text) if len(w) >= MIN_LETTERS)
    pool: list[int] = []
    for word, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):  # ties by spelling: deterministic
        ids = tokenizer(" " + word, add_special_tokens=False).input_ids
        if len(ids) == 1:
            pool.append(ids[0])
            if len(pool) == POOL_SIZE:
                break
    return tuple(pool)


def build_trial(tokenizer, distance: int, seed: int, words: int = DEFAULT_WORDS) -> Trial:
    """The prompt of one trial (see the module docstring), deterministic in ``seed``."""
    pool = word_pool(tokenizer)
    if distance < 1:
        raise ValueError(f"distance must be a positive number of filler tokens, got {distance}")
    if not 2 <= words <= len(pool):
        raise ValueError(f"words must be in [2, {len(pool)}] (one word is never scored), got {words}")
    rng = random.Random(seed)
    chosen = rng.sample(pool, words)

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    bos = [tokenizer.bos_token_id] if data.wants_bos(tokenizer) else []
    stream = data.token_stream(FILLER_CORPUS, data.Split.EVAL, tokenizer, distance + OFFSETS, add_bos=False)
    offset = rng.randrange(0, OFFSETS)
    filler = stream[offset:offset + distance].tolist()
    head = bos + encode(HEADER)
    cue = encode(SEPARATOR + HEADER)
    ids = head + chosen + encode(SEPARATOR) + filler + cue + chosen
    repeat = len(ids) - words
    return Trial(torch.tensor(ids, dtype=torch.long), tuple(tokenizer.decode([t]).strip() for t in chosen),
                 len(head), repeat, distance)


@torch.no_grad()
def copy_logits(model, trial: Trial, method) -> torch.Tensor:
    """``[N - 1, vocab]`` next-token logits of the counted tokens: the prompt up to the repeat prefilled through
    a fresh cache (or session) of ``method``, then the repeat fed token by token."""
    from kvguard.control.decoding import CacheDecoder

    decoder = method.session(model) if method.live else CacheDecoder(model, method.make_cache(model))
    ids = trial.ids
    decoder.prefill(ids[:trial.repeat])  # its logits predict the first word, which is not counted
    return torch.stack([decoder.step(int(t)) for t in ids[trial.repeat:trial.repeat + len(trial.words) - 1]])


def run(model, tokenizer, method, distances: list[int], trials: int, words: int = DEFAULT_WORDS,
        progress: bool = True) -> list[RecallResult]:
    """Top-1 and NLL of ``method`` per distance over ``trials`` prompts each (the same prompts for every
    method: seed ``distance * 1000 + trial``)."""
    from tqdm.auto import tqdm

    if trials < 1:
        raise ValueError(f"trials must be a positive integer, got {trials}")
    results = []
    bar = tqdm(total=len(distances) * trials, desc=f"recall {method.name}", disable=not progress, leave=False)
    for distance in distances:
        scores = []
        for trial_index in range(trials):
            trial = build_trial(tokenizer, distance, seed=distance * 1000 + trial_index, words=words)
            scores.append(score_copy(copy_logits(model, trial, method), trial.targets))
            bar.update()
        tokens = sum(s.tokens for s in scores)
        results.append(RecallResult(method.name, distance, words, trials, tokens,
                                    sum(s.correct for s in scores) / tokens, sum(s.nll_sum for s in scores) / tokens,
                                    tuple(s.correct / s.tokens for s in scores)))
    bar.close()
    return results


def markdown_table(results: list[RecallResult]) -> str:
    """The results as a markdown table (what ``kvguard eval --task recall`` prints)."""
    lines = ["| method | distance | words | trials | tokens | top1 | nll | top1 per trial |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        spread = " ".join(f"{a:.2f}" for a in r.trial_top1)
        lines.append(f"| {r.method} | {r.distance} | {r.words} | {r.trials} | {r.tokens} | {r.top1:.3f} | {r.nll:.3f} | "
                     f"{spread} |")
    return "\n".join(lines)
