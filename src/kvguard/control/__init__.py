"""The run-time feedback loop: watch decoding, decide, compensate, log.

:mod:`.monitor` gathers per-token evidence (attention entropy, the quantization error read), :mod:`.policy`
turns a window of it into decisions (a pure state machine), :mod:`.recompute` restores full-precision K/V at
chosen positions, :mod:`.session` is the loop that ties them to a cache (with the core's risk classifier,
:mod:`kvguard.risk`, behind dynamic precision), :mod:`.events` what is logged, :mod:`.decoding` and
:mod:`.sampling` the one decode loop.
"""
