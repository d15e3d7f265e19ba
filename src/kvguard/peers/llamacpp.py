"""llama.cpp, the engine CPU users pick, as a peer in ``kvguard eval``: its own KV-cache types, run through
``llama-cpp-python`` on the very GGUF file an embedded model comes from and on kvguard's token ids.

    score = llamacpp.score(gguf, ids, llamacpp.SPECS["llamacpp-q4_0"], chunk=1, reference=ref)
    llamacpp.kv_bytes(llamacpp.SPECS["llamacpp-q4_0"], fp16_bytes)     # GGML's block sizes

What is run: ``Llama(model_path=<gguf>, n_ctx=<the stream>, n_batch=n_ubatch=<chunk>, type_k=..., type_v=...,
flash_attn=True)`` (llama.cpp stores a quantized V only under flash attention), ``chunk`` tokens per decode
(1: true decoding). llama.cpp's own defaults stay: its Hadamard rotation of a quantized K/V (on when
head_dim % 64 == 0, both embedded models) is applied; its weights are the GGUF's own quantized ones, which
kvguard's transformers model holds dequantized (f16 against kvguard's ``fp16``, SmolLM2, 2,048 eval prose
tokens, chunk 1: -0.01 % perplexity, KL 0.0033, top-1 0.965). The chunk is llama.cpp's ubatch, and its CPU
kernels depend on it: on SmolLM2 chunk 32 scores exactly like chunk 1, chunk 64 does not (+1.1 % perplexity on
256 tokens; ``benchmarks/llamacpp_agreement.py`` printed these figures, in the history: commit 0ded4c2).

The quality columns of these rows are against ``llamacpp-f16`` on the same tokens (llama.cpp's own FP16
cache), not against kvguard's ``fp16``: what is measured is the error llama.cpp's KV types add inside
llama.cpp. Bytes come from GGML's blocks (:data:`BLOCKS`), scaled from the FP16 bytes kvguard counts for the
same tokens, so that sliding-window layers are counted the same way as kvguard's own rows.

Decode speed (``kvguard eval --task speed``): :func:`decoder` wraps the same engine as a
:class:`~kvguard.control.decoding.Decoder` (``prefill(ids)`` in batches of :data:`PREFILL_BATCH`, llama.cpp's
default, then ``step(token)`` one token per ``llama_decode``, the last position's logits only), so the speed
task times it with the very loop and clock it times kvguard's caches with.

``llama_cpp`` is imported only when a method runs; without it (or without a GGUF) a row says why
(:class:`~kvguard.peers.PeerUnsupported`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvguard.peers import PeerUnsupported

if TYPE_CHECKING:  # scoring pulls in transformers; this module is imported by the CLI's parser
    from kvguard.logprob_file import LogprobFile
    from kvguard.scoring import StreamScore

PACKAGE = "llama-cpp-python==0.3.36"
PREFILL_BATCH = 512  # llama.cpp's default n_batch: a prompt is fed in pieces of this many tokens
PREFIX = "llamacpp-"
REFERENCE = PREFIX + "f16"


class GGMLType(str, Enum):
    """A KV storage type of llama.cpp (``--cache-type-k`` / ``--cache-type-v``); the value is llama.cpp's name."""

    F16 = "f16"
    Q8_0 = "q8_0"
    Q5_0 = "q5_0"
    Q4_1 = "q4_1"
    Q4_0 = "q4_0"
    IQ4_NL = "iq4_nl"

    @property
    def block(self) -> Block:
        return BLOCKS[self]

    def ggml_id(self, llama_cpp) -> int:
        """The ``GGML_TYPE_*`` constant of the installed ``llama_cpp`` (F16 1, Q4_0 2, ... IQ4_NL 20)."""
        return getattr(llama_cpp, f"GGML_TYPE_{self.name}")


@dataclass(frozen=True)
class Block:
    """GGML's storage unit: ``nbytes`` bytes hold ``values`` consecutive values of one K or V row."""

    values: int
    nbytes: int

    @property
    def bytes_per_value(self) -> float:
        return self.nbytes / self.values


BLOCKS: dict[GGMLType, Block] = {
    GGMLType.F16: Block(1, 2),
    GGMLType.Q8_0: Block(32, 34),  # an fp16 scale + 32 int8
    GGMLType.Q5_0: Block(32, 22),  # an fp16 scale + 32 fifth bits (4 B) + 32 nibbles (16 B)
    GGMLType.Q4_1: Block(32, 20),  # an fp16 scale and an fp16 min + 32 nibbles
    GGMLType.Q4_0: Block(32, 18),  # an fp16 scale + 32 nibbles
    GGMLType.IQ4_NL: Block(32, 18),  # an fp16 scale + 32 nibbles indexing a fixed non-uniform 16-value grid
}


@dataclass(frozen=True)
class KVSpec:
    """One llama.cpp cache: ``type_k`` for keys, ``type_v`` for values; ``name`` is what ``--methods`` takes."""

    name: str
    type_k: GGMLType
    type_v: GGMLType

    def description(self) -> str:
        side = f"K and V {self.type_k.value}" if self.type_k is self.type_v else \
            f"K {self.type_k.value}, V {self.type_v.value}"
        blocks = sorted({self.type_k, self.type_v}, key=list(GGMLType).index)
        sizes = ", ".join(f"{t.value}: {t.block.nbytes} B per {t.block.values} values" if t.block.values > 1 else
                          f"{t.value}: {t.block.nbytes} B per value" for t in blocks)
        role = f"the reference of the {PREFIX}* rows" if self.name == REFERENCE else f"deltas against {REFERENCE}"
        return f"llama.cpp KV cache, {side} ({sizes}); {role}"


SPECS: dict[str, KVSpec] = {
    s.name: s
    for s in [KVSpec(PREFIX + t.value, t, t) for t in GGMLType]
    + [KVSpec(PREFIX + "q8_0-q4_0", GGMLType.Q8_0, GGMLType.Q4_0)]
}


def kv_bytes(spec: KVSpec, fp16_bytes: int) -> int:
    """Bytes ``spec`` stores for a cache that takes ``fp16_bytes`` in FP16 (K and V halves of equal size):
    each half scaled by its type's bytes per value / 2. GGML blocks run along a head's row (head_dim, a
    multiple of 32 in every model llama.cpp quantizes the cache of), so no block is partial."""
    values = fp16_bytes // 4  # per side: fp16_bytes = 2 sides x 2 bytes x values
    return sum(values * t.block.nbytes // t.block.values for t in (spec.type_k, spec.type_v))


def _import_llama_cpp():
    try:
        import llama_cpp
    except (ImportError, OSError) as err:  # OSError: the package is there but its compiled library is not
        raise PeerUnsupported(f"the {PREFIX}* methods need llama-cpp-python, which is not installed here ({err}): "
                              f"pip install {PACKAGE}  (or `make peers`, which builds it once per machine; it compiles "
                              f"llama.cpp and needs cmake and a C++ compiler)") from err
    return llama_cpp


@contextmanager
def _engine(gguf: Path, spec: KVSpec, *, n_ctx: int, chunk: int, gpu: bool = False):
    """``(llama_cpp, Llama)`` with ``spec``'s cache, closed on exit; ``gpu``: offload every layer (a CPU build of
    llama.cpp ignores it and runs on the CPU)."""
    llama_cpp = _import_llama_cpp()
    # torch's count (OMP_NUM_THREADS, torch.set_num_threads), so both engines run on the same threads. llama.cpp's
    # threads spin at every op's barrier: on cores other work also runs, one thread decodes many times faster.
    threads = torch.get_num_threads()
    try:
        # logits_all=False: Llama would otherwise keep every logit ([n_ctx, vocab], 2 GB for Gemma 3 at 2,048
        # tokens) next to the reference; _logits reads each chunk's rows out of the context instead.
        llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=chunk, n_ubatch=chunk, logits_all=False,
                              type_k=spec.type_k.ggml_id(llama_cpp), type_v=spec.type_v.ggml_id(llama_cpp),
                              flash_attn=True, n_threads=threads, n_threads_batch=threads, n_gpu_layers=-1 if gpu else 0,
                              verbose=False)
    except (ValueError, RuntimeError) as err:
        raise PeerUnsupported(f"{spec.name}: llama.cpp refused {gguf.name}: {err}") from err
    try:
        yield llama_cpp, llm
    finally:
        llm.close()


def _logits(llama_cpp, llm, tokens: list[int], chunk: int, progress: bool, desc: str) -> Iterator[torch.Tensor]:
    """``[n, vocab]`` float32 logits of ``tokens``, ``chunk`` per decode, every position of a chunk an output
    (what ``Llama.eval`` does with ``logits_all=True``, without keeping them all)."""
    import numpy as np  # llama_cpp's own dependency
    from tqdm.auto import tqdm

    vocab = llm.n_vocab()
    batch = llama_cpp.llama_batch_init(chunk, 0, 1)
    try:
        for start in tqdm(range(0, len(tokens), chunk), desc=desc, unit="chunk", disable=not progress, leave=False):
            piece = tokens[start:start + chunk]
            _decode(llama_cpp, llm, batch, piece, start, every_output=True)
            # [n, vocab] over llama.cpp's own buffer, which the next decode overwrites: copied out.
            rows = np.ctypeslib.as_array(llama_cpp.llama_get_logits(llm.ctx), shape=(len(piece), vocab))
            yield torch.from_numpy(rows.copy())
    finally:
        llama_cpp.llama_batch_free(batch)


def _decode(llama_cpp, llm, batch, piece: list[int], start: int, *, every_output: bool) -> None:
    """One ``llama_decode`` of ``piece`` at positions ``start..``; logits for every token of it, or the last only."""
    batch.n_tokens = len(piece)
    for i, token in enumerate(piece):
        batch.token[i], batch.pos[i], batch.logits[i] = token, start + i, every_output or i == len(piece) - 1
        batch.n_seq_id[i], batch.seq_id[i][0] = 1, 0
    code = llama_cpp.llama_decode(llm.ctx, batch)
    if code != 0:
        raise RuntimeError(f"llama_decode returned {code} at token {start}")


class Decoder:
    """llama.cpp as a :class:`~kvguard.control.decoding.Decoder`: ``prefill(ids)`` then ``step(token)``, each
    returning the next-token logits ``[vocab]`` (float32, on the CPU, where llama.cpp hands them out)."""

    def __init__(self, llama_cpp, llm) -> None:
        self.llama_cpp, self.llm = llama_cpp, llm
        self.length = 0
        self._batch = llama_cpp.llama_batch_init(PREFILL_BATCH, 0, 1)

    def close(self) -> None:
        self.llama_cpp.llama_batch_free(self._batch)

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        import numpy as np  # llama_cpp's own dependency

        for start in range(0, len(tokens), PREFILL_BATCH):
            piece = tokens[start:start + PREFILL_BATCH]
            _decode(self.llama_cpp, self.llm, self._batch, piece, self.length, every_output=False)
            self.length += len(piece)
        # [vocab] over llama.cpp's own buffer, which the next decode overwrites: copied out.
        row = self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return torch.from_numpy(np.ctypeslib.as_array(row, shape=(self.llm.n_vocab(),)).copy())

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        tokens = torch.as_tensor(ids).reshape(-1).tolist()
        if not tokens:
            raise ValueError("empty prompt")
        return self._feed(tokens)

    def step(self, token: int) -> torch.Tensor:
        return self._feed([int(token)])


@contextmanager
def decoder(gguf: Path | None, spec: KVSpec, *, n_ctx: int, gpu: bool = False) -> Iterator[Decoder]:
    """A :class:`Decoder` over ``gguf`` with ``spec``'s cache for up to ``n_ctx`` tokens, closed on exit.

    Raises:
        PeerUnsupported: as :func:`score` does.
    """
    with _engine(_require_gguf(gguf, spec), spec, n_ctx=n_ctx, chunk=PREFILL_BATCH, gpu=gpu) as (llama_cpp, llm):
        engine = Decoder(llama_cpp, llm)
        try:
            yield engine
        finally:
            engine.close()


def _require_gguf(gguf: Path | None, spec: KVSpec) -> Path:
    if gguf is None:
        from kvguard import models

        raise PeerUnsupported(f"{spec.name} runs llama.cpp on the GGUF file an embedded model comes from "
                              f"[{', '.join(models.EMBEDDED)}]; this model is a local folder with no GGUF")
    return Path(gguf)


def score(gguf: Path | None, ids: torch.Tensor, spec: KVSpec, *, chunk: int = 1,
          reference: torch.Tensor | LogprobFile | None = None, keep_logprobs: LogprobFile | None = None,
          progress: bool = False) -> StreamScore:
    """Scores of ``ids`` (``[T]``) teacher-forced through llama.cpp with ``spec``'s cache on ``gguf``, ``chunk``
    tokens per decode; ``reference``: ``[T - 1, vocab]`` log-probabilities (``llamacpp-f16``'s) for KL and top-1
    agreement, and ``keep_logprobs`` a :class:`~kvguard.logprob_file.LogprobFile` for this run's (as in
    :func:`kvguard.scoring.score_logits`).

    Raises:
        PeerUnsupported: no GGUF (not an embedded model), ``llama_cpp`` not installed, or llama.cpp refusing
            the model or the cache type.
    """
    gguf = _require_gguf(gguf, spec)
    from kvguard.scoring import score_logits

    ids = torch.as_tensor(ids).reshape(-1)
    tokens = ids[:-1].tolist()  # the last token is only a target
    with _engine(gguf, spec, n_ctx=max(len(tokens), 1), chunk=chunk) as (llama_cpp, llm):
        return score_logits(ids, _logits(llama_cpp, llm, tokens, chunk, progress, spec.name), reference=reference,
                            keep_logprobs=keep_logprobs)
