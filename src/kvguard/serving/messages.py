"""What a worker tells the request waiting on its job: the text as it is decoded, then how the job ended.

The worker thread puts messages on the job's asyncio queue, through the event loop (thread-safe); the HTTP
handler reads them in order and dispatches on their type. Every job ends with exactly one :class:`Done` or
:class:`Failed`; before it, any number of :class:`TextDelta`. The time of the first token travels in
:class:`Done`, which is where the request's log line and metrics read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvguard.control.decoding import FinishReason


@dataclass(frozen=True)
class TextDelta:
    """Text decoded since the previous delta (detokenized incrementally; a possible stop string held back)."""

    text: str


@dataclass(frozen=True)
class Done:
    """The job finished: why, how many tokens, the session's summary, and when (``time.time()``).

    Attributes:
        finish_reason: ``length``, ``stop``, or ``cancelled`` (the client left; then nothing is answered).
        completion_tokens: tokens generated.
        summary: the session's :meth:`~kvguard.control.session.LiveSession.summary`; ``None`` when it never ran.
        first_token_at, finished_at: wall-clock times of the first token and of the end; ``None`` without tokens.
    """

    finish_reason: FinishReason
    completion_tokens: int
    summary: dict | None = None
    first_token_at: float | None = None
    finished_at: float | None = None


@dataclass(frozen=True)
class Failed:
    """The job raised: ``message`` names the error (answered as a 500)."""

    message: str


Message = TextDelta | Done | Failed
