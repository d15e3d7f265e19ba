"""Serving: ``kvguard serve`` (an OpenAI-compatible server under the feedback loop) and ``kvguard export``.

:mod:`.protocol` validates requests, :mod:`.engine` decodes them on a worker pool, :mod:`.metrics` exports
Prometheus metrics, :mod:`.app` is the HTTP application; :mod:`.export` writes calibrated FP8 scales in the
files vLLM and SGLang load.
"""
