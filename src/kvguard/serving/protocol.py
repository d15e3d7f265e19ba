"""The OpenAI-compatible request protocol of ``kvguard serve``: validation, errors, detokenization.

A request body becomes a :class:`GenerationRequest` or a :class:`RequestError` (HTTP status, OpenAI's error
body naming the field); :class:`TextStream` turns generated tokens into text that never ends in half a character
or the start of a stop string.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from kvguard import data
from kvguard.control.sampling import SEED_RANGE, Sampler

MAX_BODY_BYTES = 1 << 20
MAX_STOP_STRINGS = 4
# No field takes a longer integer; Python's int() refuses more than 4,300 digits with a bare ValueError, which
# would leave the body unparsed and the field unnamed.
MAX_INTEGER_DIGITS = 100


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class HugeInteger:
    """A JSON integer literal longer than :data:`MAX_INTEGER_DIGITS`: kept as its length, not converted, so the
    field that holds it refuses it by name (it is neither an ``int`` nor a ``float``)."""

    digits: int

    def __repr__(self) -> str:
        return f"an integer of {self.digits} digits"


def _parse_int(literal: str) -> int | HugeInteger:
    return int(literal) if len(literal) <= MAX_INTEGER_DIGITS else HugeInteger(len(literal.lstrip("-")))


def parse_json(raw: bytes):
    """The request body's JSON value, or a 400 saying why it is not one."""
    try:
        return json.loads(raw, parse_int=_parse_int)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RequestError(400, f"the request body is not valid JSON: {err}") from None
    except RecursionError:
        raise RequestError(400, "the request body nests JSON arrays or objects too deeply") from None


def _show(value, limit: int = 60) -> str:
    """``repr(value)``, cut to one short line (an error message never echoes a megabyte back)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _unicode(text: str, name: str) -> str:
    """``text``, unless it holds a lone UTF-16 surrogate (JSON's ``"\\ud800"`` escape), which is not Unicode
    text and which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise RequestError(400, f"'{name}' is not valid Unicode: a lone surrogate {text[err.start]!r} at character "
                                f"{err.start}", param=name) from None
    return text


@dataclass
class GenerationRequest:
    """One validated completion request."""

    endpoint: str  # "completions" or "chat.completions"
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False

    @property
    def sampler(self) -> Sampler:
        return Sampler(self.temperature, self.top_p, self.seed)


def _number(body: dict, name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(400, f"'{name}' must be a number, got {_show(value)}", param=name)
    if value < lo or value > hi or (lo_open and value == lo):
        raise RequestError(400, f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}", param=name)
    return float(value)


def _integer(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(400, f"'{name}' must be an integer, got {_show(value)}", param=name)
    return value


def _seed(body: dict) -> int | None:
    seed = _integer(body, "seed")
    if seed is not None and not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise RequestError(400, f"'seed' must be in [-2**63, 2**64), got {seed}", param="seed")
    return seed


def _bool(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(400, f"'{name}' must be true or false, got {_show(value)}", param=name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(400, "'stop' must be a non-empty string or a list of them", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(400, f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", param="stop")
    return tuple(_unicode(s, "stop") for s in stops)


def _message_text(message, index: int) -> tuple[str, str]:
    if not isinstance(message, dict):
        raise RequestError(400, f"messages[{index}] must be an object with 'role' and 'content'", param="messages")
    role, content = message.get("role"), message.get("content")
    if role not in ("system", "developer", "user", "assistant"):
        raise RequestError(400, f"messages[{index}].role must be system, developer, user or assistant, got {_show(role)}",
                           param="messages")
    if isinstance(content, list):  # content parts: only text is understood
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(400, f"messages[{index}].content: only text parts are supported", param="messages")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise RequestError(400, f"messages[{index}].content must be a string or a list of text parts",
                           param="messages")
    return ("system" if role == "developer" else role), _unicode(content, "messages")


@dataclass(frozen=True)
class Limits:
    """What one request may ask for."""

    max_prompt_tokens: int
    max_new_tokens: int
    context: int  # the model's context length


class RequestParser:
    """Turns request bodies into :class:`GenerationRequest` (the tokenizer, the model's context, the limits)."""

    def __init__(self, tokenizer, model_name: str, limits: Limits) -> None:
        self.tok = tokenizer
        self.model_name = model_name
        self.limits = limits
        self.bos = tokenizer.bos_token_id if data.wants_bos(tokenizer) else None

    def parse(self, endpoint: str, body) -> GenerationRequest:
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise RequestError(404, f"model {_show(model)} is not served here; this server serves {self.model_name!r}",
                               param="model", code="model_not_found")
        n = _integer(body, "n")
        if n not in (None, 1):
            raise RequestError(400, f"'n' must be 1 (one choice per request), got {n}", param="n")
        for unsupported in ("logprobs", "top_logprobs", "echo", "tools", "functions", "best_of", "suffix"):
            value = body.get(unsupported)
            if value is None or value is False or (unsupported == "best_of" and value == 1):
                continue
            raise RequestError(400, f"'{unsupported}' is not supported by kvguard serve", param=unsupported)
        ids = self._chat_ids(body) if endpoint == "chat.completions" else self._prompt_ids(body)
        if not ids:
            raise RequestError(400, "the prompt is empty", param="prompt" if endpoint == "completions" else "messages")
        if len(ids) > self.limits.max_prompt_tokens:
            raise RequestError(400, f"the prompt has {len(ids)} tokens; this server takes at most "
                                    f"{self.limits.max_prompt_tokens} (--max-prompt-tokens)",
                               param="prompt" if endpoint == "completions" else "messages",
                               code="context_length_exceeded")
        room = min(self.limits.max_new_tokens, self.limits.context - len(ids))
        if room < 1:
            raise RequestError(400, f"the prompt has {len(ids)} tokens and fills the model's {self.limits.context}-token "
                                    "context", code="context_length_exceeded")
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _integer(body, name)
        if max_tokens is None:
            max_tokens = min(16, room) if endpoint == "completions" else room  # OpenAI's defaults
        if max_tokens < 1:
            raise RequestError(400, f"'{name}' must be >= 1, got {max_tokens}", param=name)
        if max_tokens > room:
            raise RequestError(400, f"'{name}' is {max_tokens}; at most {room} new tokens fit (--max-new-tokens "
                                    f"{self.limits.max_new_tokens}, model context {self.limits.context}, prompt {len(ids)})",
                               param=name, code="context_length_exceeded")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise RequestError(400, "'stream_options' must be an object", param="stream_options")
        stream = _bool(body, "stream")
        return GenerationRequest(
            endpoint=endpoint, prompt_ids=ids, max_tokens=max_tokens,
            temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
            stop=_stop(body), seed=_seed(body), stream=stream,
            include_usage=stream and bool(options.get("include_usage")), ignore_eos=_bool(body, "ignore_eos"))

    def _prompt_ids(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = len(self.tok)
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise RequestError(400, f"prompt token ids must be in [0, {vocab}), got {bad[:3]}", param="prompt")
            return list(prompt)
        if not isinstance(prompt, str):
            raise RequestError(400, "'prompt' must be a string, a list of one string, or a list of token ids "
                                    "(batches of prompts are not supported: send one request each)", param="prompt")
        ids = self.tok(_unicode(prompt, "prompt"), add_special_tokens=False)["input_ids"]
        return ([self.bos] if self.bos is not None and ids else []) + ids

    def _chat_ids(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "'messages' must be a non-empty list", param="messages")
        turns = [dict(zip(("role", "content"), _message_text(m, i))) for i, m in enumerate(messages)]
        if getattr(self.tok, "chat_template", None):
            text = self.tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
            return self.tok(text, add_special_tokens=False)["input_ids"]
        text = "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant:"
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return ([self.bos] if self.bos is not None else []) + ids


class TextStream:
    """Incremental detokenization that never emits half a character or the start of a stop string."""

    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self.tok = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.emitted = 0
        self.text = ""
        self.stopped = False

    def add(self, token: int) -> str:
        """The new text ``token`` makes final ('' while it may still change)."""
        self.ids.append(token)
        self.text = self.tok.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            at = self.text.find(s, max(0, self.emitted - len(s)))
            if at >= 0:
                self.text = self.text[:at]
                self.stopped = True
                return self.flush()
        if self.text.endswith("\ufffd"):
            return ""
        end = max(self.emitted, len(self.text) - self.hold)
        out, self.emitted = self.text[self.emitted:end], end
        return out

    def flush(self) -> str:
        text = self.text.rstrip("\ufffd")
        out, self.emitted = text[self.emitted:], len(text)
        return out
