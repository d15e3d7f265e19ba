"""The peers kvguard is measured against, each reproduced or run as its users get it.

:mod:`.quantized_cache` is transformers' own ``QuantizedCache`` (quanto and hqq backends); :mod:`.llamacpp` is
llama.cpp's KV types, run in llama.cpp through ``llama-cpp-python``. ``kvguard eval`` names them as methods
(:mod:`kvguard.evaluation.methods`); a peer never imports evaluation. Backends import lazily: a peer that cannot
run here raises :class:`PeerUnsupported`, whose message says what to install, and its row says why.

vLLM's per-token-head formats (:mod:`kvguard.per_token_head`) and the engines' FP8 cache (:mod:`kvguard.fp8`)
stay in the core: ``kvguard export`` chooses skip lists through them, not only ``kvguard eval``.
"""


class PeerUnsupported(RuntimeError):
    """A peer cannot run here: the backend package is missing, or the peer refuses the model."""
