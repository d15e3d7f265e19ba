"""Measuring methods side by side on the same tokens: ``kvguard eval``.

:mod:`.methods` names every cache (kvguard's plans, the profile's, the peers of :mod:`kvguard.peers`), :mod:`.harness`
runs them on a stream, scored by the core's :mod:`kvguard.scoring` (streamed, simulated, live) with
:mod:`kvguard.metrics`; :mod:`.passkey`, :mod:`.recall` (a word list copied from far back) and :mod:`.speed` are
the other tasks.
"""
