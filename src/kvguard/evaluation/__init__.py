"""Measuring methods side by side on the same tokens: ``kvguard eval``.

:mod:`.methods` names every cache (kvguard's plans, the profile's, the peers of :mod:`.peers`), :mod:`.harness`
runs them on a stream, :mod:`.scoring` scores streams (streamed, simulated, live) with :mod:`.metrics`;
:mod:`.passkey`, :mod:`.recall` (a word list copied from far back) and :mod:`.speed` are the other
tasks.
"""
