"""Offline, model-specific calibration: it writes the profile that the run-time half only loads.

``kvguard calibrate`` runs :func:`kvguard.calibration.pipeline.calibrate`: K/V statistics and the entropy
baseline (:mod:`.kv_statistics`), the latency cost model (:mod:`.latency`), per-layer / per-head sensitivity
(:mod:`.sensitivity`), the hierarchical search (:mod:`.search`), all scored on held-out calibration text
(:mod:`.heldout`, :mod:`.samples`), the monitor's calibration (:mod:`.monitor_fit`, :mod:`.signals`), spread
over Ray when asked (:mod:`.distributed`), checkpointed (:mod:`.checkpoints`); :mod:`.report` draws the result.
Nothing outside this package imports it.
"""
