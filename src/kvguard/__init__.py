"""kvguard: calibrated KV-cache quantization with real-time error compensation.

    import kvguard
    model, tok = kvguard.load("smollm2-135m")
    profile = kvguard.Profile.load("profiles/smollm2", model)
    cache = profile.plan.make_cache(model.config, profile.static_scales())       # a transformers Cache
    session = kvguard.LiveSession.from_profile(model, profile)                    # the feedback loop

The public names are imported on first use, so ``import kvguard`` stays cheap.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "KVGuardCache": "kvguard.cache",
    "CacheConfig": "kvguard.config",
    "MonitorConfig": "kvguard.config",
    "Precision": "kvguard.precision",
    "Plan": "kvguard.plan",
    "Profile": "kvguard.profile",
    "LiveSession": "kvguard.control.session",
    "Sampler": "kvguard.control.sampling",
    "load": "kvguard.models",
}
__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'kvguard' has no attribute {name!r}")
