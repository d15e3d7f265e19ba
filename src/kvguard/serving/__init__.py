"""Serving: ``kvguard serve``, an OpenAI-compatible server under the feedback loop.

:mod:`.protocol` validates requests, :mod:`.engine` decodes them on a worker pool and reports each job's text
and end as typed :mod:`.messages`, :mod:`.metrics` exports Prometheus metrics, :mod:`.app` is the HTTP
application, :mod:`.status_page` its HTML page, :mod:`.settings` its configuration. What other engines load (``kvguard export``) is :mod:`kvguard.export`.
"""
