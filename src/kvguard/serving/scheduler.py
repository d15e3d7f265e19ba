"""The step scheduler behind ``kvguard serve``: one thread runs the model, and every request in flight advances in
the same forward.

Each step the scheduler

1. drops the sequences whose clients left (their caches are freed at once) and admits waiting requests, oldest
   first, while the batch has room (``max_batch``) and their KV bytes fit the budget (:class:`Budget`);
2. builds one packed row (:mod:`kvguard.packed`): every decoding sequence's last token first, then prompt chunks
   of the sequences still prefilling, oldest first, until the step's token budget (``step_tokens``) is spent, so a
   long prompt is fed over several steps while the others keep decoding, instead of stalling them;
3. runs **one** model forward over the row: projections and MLP batched over every sequence, attention per
   sequence over its own cache;
4. hands each sequence what it was fed (:meth:`~kvguard.control.session.LiveSession.fed_token`): its feedback loop
   watches its own attention and, when a monitoring step is due, acts on its own cache (a compensation runs its own
   forwards, for that sequence only, before the next step); then draws its next token, streams the text, and ends
   it on a stop, the end-of-sequence token or its ``max_tokens``.

A prompt is fed as :meth:`LiveSession.prefill <kvguard.control.session.LiveSession.prefill>` feeds it (all but its
last token in chunks, the last token as a step, the prompt check), so a request's tokens are those it would get
alone, up to the float summation order of a batched matmul.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvguard import heap, packed
from kvguard.control.decoding import FinishReason
from kvguard.serving.messages import Done, Failed, TextDelta
from kvguard.serving.protocol import TextStream


@dataclass(frozen=True)
class Budget:
    """The KV bytes the server may hold: every admitted sequence reserves what its plan stores for its prompt and
    ``max_tokens`` (``bytes_for(tokens)``), and a sequence is admitted only while the reservations fit ``total``."""

    total: int
    bytes_for: Callable[[int], int]


@dataclass(frozen=True)
class Sizing:
    """What one sequence may hold in KV bytes, by its token count, under a plan.

    Past the sinks and the window every token is stored once at its tier, so a plan's bytes are affine in the tokens:
    measured at two lengths (:meth:`of`), with a group of FP16 tokens added for the window's ebb and flow, the line is
    an upper bound at any length (below the window, tokens are FP16 and lie under it). With the feedback loop on, a
    sequence may grow past its plan by what the loop's memory budget allows: it keeps ``min_saving_kept`` of the
    plan's saving at the same length.
    """

    intercept: float
    per_token: float
    fp16_per_token: float
    min_saving_kept: float | None = None  # None: no loop

    @classmethod
    def of(cls, plan, model_config, scales=None, min_saving_kept: float | None = None) -> "Sizing":
        (s1, _), (s2, f2) = (plan.kv_bytes(model_config, t, scales) for t in (1024, 2048))
        slope, fp16 = (s2 - s1) / 1024, f2 / 2048
        return cls(s2 - 2048 * slope + plan.cache.group_size * fp16, slope, fp16, min_saving_kept)

    def reserve(self, tokens: int) -> int:
        stored = self.intercept + self.per_token * tokens
        if self.min_saving_kept is None:
            return int(stored)
        fp16 = self.fp16_per_token * tokens
        return int(max(stored, fp16 - self.min_saving_kept * (fp16 - stored)))


@dataclass
class _Sequence:
    """A request in flight: its session (cache and feedback loop), where its prompt is, what it generated."""

    job: object
    session: object
    prompt: torch.Tensor  # [P]
    reserved: int  # KV bytes reserved against the budget
    draw: Callable[[torch.Tensor], int]
    text: TextStream
    fed: int = 0  # prompt tokens fed
    tokens: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    last_token_at: float | None = None

    @property
    def prefilling(self) -> bool:
        return self.fed < self.prompt.numel()


@dataclass(frozen=True)
class _Fed:
    """What one piece of a step fed a sequence: prompt tokens (``emits`` when it was the prompt's last) or its last
    generated token."""

    seq: _Sequence
    ids: torch.Tensor
    prompt: bool
    emits: bool


class Scheduler:
    """Admission, packing and stepping (see the module docstring); :meth:`submit` from any thread."""

    def __init__(self, engine, *, max_batch: int, step_tokens: int, budget: Budget) -> None:
        self.engine, self.max_batch, self.step_tokens, self.budget = engine, max_batch, step_tokens, budget
        self.waiting: deque = deque()  # of (job, reserved bytes)
        self.active: list[_Sequence] = []
        self.starting = 0  # admitted, their sessions being built: in flight, not yet in ``active``
        self.reserved = 0
        self.cond = threading.Condition()
        self.stopped = False
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Run the loop on a thread of its own (:meth:`run` runs it on the caller's)."""
        self.thread = threading.Thread(target=self.run, name="kvguard-scheduler", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify()

    def submit(self, job, reserved: int) -> None:
        with self.cond:
            self.waiting.append((job, reserved))
            self.cond.notify()

    def queued_ahead(self, need: int) -> int | None:
        """How many waiting requests a new one needing ``need`` bytes would queue behind; ``None`` when it would
        start at the next step (the batch has room, and every request before it and itself fit the budget)."""
        with self.cond:
            slots, free = self.max_batch - self.in_flight, self.budget.total - self.reserved
            for i, (job, reserved) in enumerate(self.waiting):
                if slots == 0 or reserved > free:
                    return len(self.waiting) - i
                slots, free = slots - 1, free - reserved
            return None if slots > 0 and need <= free else 0

    @property
    def in_flight(self) -> int:
        return len(self.active) + self.starting

    # ------------------------------------------------------------------ the loop
    def run(self, keep_going: Callable[[], bool] = lambda: True) -> None:
        """Step until :meth:`stop` (or until ``keep_going()`` turns false, checked at least twice a second).

        Run it on the thread that loaded the model when the process allows (``kvguard serve`` does): torch's
        OpenMP threads belong to the thread that first ran a parallel op, and another thread's ops get a team of
        their own; with more OpenMP threads than cores, libgomp's threads sleep instead of spinning between ops,
        and a batched decode step, hundreds of small ops, ran at 0.4x its speed on 2 cores."""
        torch.set_num_threads(self.engine.torch_threads)
        worked = False
        while True:
            emptied = False
            if worked and not self.active:  # ``active`` is this thread's own; ``waiting`` is read under the lock
                with self.cond:
                    emptied = not self.waiting
            if emptied:
                # What the batch's forwards freed in the middle of the heap goes back to the kernel: after a churn
                # of 64 requests the server held 16.6 % more than before the load without this.
                heap.release()
                worked = False
            with self.cond:
                while not self.stopped and not self.waiting and not self.active and keep_going():
                    self.cond.wait(0.5)
                if self.stopped or not keep_going():
                    return
                admitted = self._admit()
            for job, reserved in admitted:
                self._start(job, reserved)
            worked = True
            try:
                self._step()
            except Exception as err:  # noqa: BLE001 - every request in the step is answered, the server goes on
                message = f"{type(err).__name__}: {err}"
                for seq in list(self.active):
                    self._end(seq, failed=message)

    def _admit(self) -> list:
        """Move waiting jobs to the batch while there is room (under the lock); cancelled ones leave at once."""
        out = []
        while self.waiting and len(self.active) + len(out) < self.max_batch:
            job, reserved = self.waiting[0]
            if not job.cancelled.is_set() and self.reserved + reserved > self.budget.total:
                break  # oldest first: nobody overtakes a request that does not fit yet
            self.waiting.popleft()
            if job.cancelled.is_set():
                job.put(Done(FinishReason.CANCELLED, 0))
                self.engine.released(job)
                continue
            self.reserved += reserved
            out.append((job, reserved))
        self.starting += len(out)
        self.engine.metrics.waiting.set(len(self.waiting))
        return out

    def _start(self, job, reserved: int) -> None:
        r = job.request
        try:
            session = self.engine.session(job)
        except Exception as err:  # noqa: BLE001 - answered; the others go on
            job.put(Failed(f"{type(err).__name__}: {err}"))
            self._release(reserved)
            self.engine.released(job)
            return
        else:
            prompt = torch.tensor(r.prompt_ids, dtype=torch.long)
            self.active.append(_Sequence(job, session, prompt, reserved, r.sampler.start(),
                                         TextStream(self.engine.tok, r.stop)))
        finally:
            self.starting -= 1  # after the append: the admission check never sees it in neither place

    def _step(self) -> None:
        for seq in [s for s in self.active if s.job.cancelled.is_set()]:
            self._end(seq, FinishReason.CANCELLED)
        fed = self._pack()
        if not fed:
            return
        m = self.engine.metrics
        m.batch_size.set(len(fed))
        m.in_flight.set(len(self.active))
        m.kv_reserved.set(self.reserved)
        logits = packed.forward(self.engine.model, [f.seq.session.piece(f.ids) for f in fed])
        for f, row in zip(fed, logits):
            self._after(f, row)

    def _pack(self) -> list[_Fed]:
        """This step's pieces: every decoding sequence's last token, then prompt chunks, oldest first, within
        ``step_tokens``."""
        fed = [_Fed(s, torch.tensor([s.tokens[-1]]), False, True) for s in self.active if not s.prefilling]
        room = self.step_tokens - len(fed)
        for seq in self.active:
            if not seq.prefilling or room <= 0:
                continue
            rest = seq.prompt.numel() - 1 - seq.fed  # all but the last prompt token go in chunks
            n = min(room, rest) if rest > 0 else 1
            ids = seq.prompt[seq.fed:seq.fed + n]
            fed.append(_Fed(seq, ids, True, rest <= 0))
            room -= n
        return fed

    def _after(self, f: _Fed, logits: torch.Tensor) -> None:
        seq = f.seq
        session = seq.session
        if f.prompt:
            seq.fed += f.ids.numel()
            if not f.emits:
                session.fed_prompt(f.ids)
                return
            session.fed_token(int(f.ids[0]), prompt=seq.prompt.numel() > 1 and session.config.prompt_check)
        else:
            session.fed_token(int(f.ids[0]))
        self._emit(seq, seq.draw(logits))

    def _emit(self, seq: _Sequence, token: int) -> None:
        now = time.time()
        m, job, r = self.engine.metrics, seq.job, seq.job.request
        if seq.first_token_at is None:
            seq.first_token_at = now  # the time to first token is counted when the request ends (serving.app)
        else:
            m.itl.observe(now - seq.last_token_at)
        seq.last_token_at = now
        seq.tokens.append(token)
        job.generated += 1
        delta = seq.text.add(token)
        if delta:
            job.put(TextDelta(delta))
        if job.generated % 8 == 0:
            self.engine.snapshot(job, seq.session)
        eos = self.engine.tok.eos_token_id
        if seq.text.stopped or (not r.ignore_eos and eos is not None and token == eos):
            self._end(seq, FinishReason.STOP)
        elif len(seq.tokens) == r.max_tokens:
            self._end(seq, FinishReason.LENGTH)

    def _end(self, seq: _Sequence, reason: FinishReason | None = None, failed: str | None = None) -> None:
        """The sequence leaves the batch now; its cache goes with its session."""
        self.active.remove(seq)
        self._release(seq.reserved)
        job, session = seq.job, seq.session
        if failed is not None:
            job.put(Failed(failed))
        else:
            rest = seq.text.flush() if reason is not FinishReason.CANCELLED else ""
            if rest:
                job.put(TextDelta(rest))
            summary = session.summary()
            self.engine.finished(job, session, summary)
            job.put(Done(reason, len(seq.tokens), summary, seq.first_token_at, time.time()))
        self.engine.released(job)

    def _release(self, reserved: int) -> None:
        with self.cond:
            self.reserved -= reserved
