"""Export: what a serving engine (vLLM, SGLang) loads from a profile, and proof that it loaded it.

:mod:`.export` writes ``kvguard export``'s directory (the FP8 KV-cache scales, the engine arguments, a manifest
and a README); :mod:`.skip_list` is the engine's per-layer control, the layers it keeps unquantized, with the
bytes they cost; :mod:`.served_model` assembles the model folder vLLM serves an FP8 export from;
:mod:`.engine_check` loads that folder in vLLM (through :mod:`.vllm_probe`, run by vLLM's own python) and
compares every layer's scales with the export's.

Like the run-time stages, export only loads what calibration wrote: nothing here imports
:mod:`kvguard.calibration` (the skip list for a memory budget is measured there, in
:mod:`kvguard.calibration.engine_skip`, and handed to :func:`.export.export`).
"""
