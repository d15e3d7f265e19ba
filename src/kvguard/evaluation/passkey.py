"""Long-context retrieval: a random 5-digit pass key hidden in long filler text, asked back at the end.

Errors on distant tokens may never show in a 32-token entropy window or in perplexity; this task measures
whether the quantized cache still lets the model find one fact far back. The prompt is prefilled in one pass,
so the answer's tokens are the ones reading the stored (quantized) past.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

from kvguard import data

PREAMBLE = ("There is an important piece of information hidden inside a lot of irrelevant text. "
            "Find it and memorize it. I will quiz you about it.\n\n")
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key?"
ANSWER_START = " The pass key is"


@dataclass(frozen=True)
class PasskeyResult:
    method: str
    length: int
    depth: float
    trials: int
    correct: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.trials


def build_prompt(tokenizer, length: int, depth: float, seed: int) -> tuple[torch.Tensor, str]:
    """``(input_ids [length], passkey)``: a preamble, filler from the ``long`` eval split with the needle at
    ``depth`` (0 = start, 1 = end of the filler), the question, and the start of the answer. Models with a
    chat template get the text as a user message and the answer start as the assistant's."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(seed)
    key = f"{rng.randrange(10000, 100000)}"

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    needle = encode(NEEDLE.format(key=key))
    if tokenizer.chat_template:
        # Render the template around a marker to find the token spans before and after the user text.
        marker = "\u2063KVGUARD\u2063"
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": PREAMBLE + marker + QUESTION}],
                                                 tokenize=False, add_generation_prompt=True)
        before, after = rendered.split(marker)
        head, tail = encode(before), encode(after + ANSWER_START.strip())
    else:
        bos = [tokenizer.bos_token_id] if data.wants_bos(tokenizer) else []
        head, tail = bos + encode(PREAMBLE), encode(QUESTION + ANSWER_START)
    room = length - len(needle) - len(head) - len(tail)
    if room < 16:
        raise ValueError(f"length {length} is too short for the pass-key prompt (needs > {length - room + 16})")
    # A different stretch of filler per seed, so trials are not one prompt repeated.
    stream = data.token_stream("long", "eval", tokenizer, room + 4096, add_bos=False)
    offset = rng.randrange(0, 4096)
    filler = stream[offset:offset + room].tolist()
    cut = int(round(depth * room))
    ids = head + filler[:cut] + needle + filler[cut:] + tail
    return torch.tensor(ids, dtype=torch.long), key


def answer(model, tokenizer, input_ids: torch.Tensor, method, max_new_tokens: int = 8) -> str:
    """Greedy continuation of the prompt through a fresh cache (or session) of ``method``."""
    from kvguard.control.decoding import CacheDecoder, generate

    decoder = method.session(model) if method.live else CacheDecoder(model, method.make_cache(model))
    out = generate(decoder, input_ids, max_new_tokens, eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out.tokens, skip_special_tokens=True)


def is_correct(reply: str, key: str) -> bool:
    """The first number in the reply is the key."""
    found = re.search(r"\d+", reply)
    return found is not None and found.group(0) == key


def run(model, tokenizer, method, lengths: list[int], depths: list[float], trials: int,
        progress: bool = True) -> list[PasskeyResult]:
    """Accuracy of ``method`` per length and depth over ``trials`` prompts each."""
    from tqdm.auto import tqdm

    results = []
    bar = tqdm(total=len(lengths) * len(depths) * trials, desc=f"passkey {method.name}", disable=not progress, leave=False)
    for length in lengths:
        for depth in depths:
            correct = 0
            for trial in range(trials):
                ids, key = build_prompt(tokenizer, length, depth, seed=length * 1000 + round(depth * 100) * 10 + trial)
                reply = answer(model, tokenizer, ids, method)
                correct += is_correct(reply, key)
                bar.update()
            results.append(PasskeyResult(method.name, length, depth, trials, correct))
    bar.close()
    return results
