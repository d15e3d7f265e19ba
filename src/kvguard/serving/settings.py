"""What ``kvguard serve`` is asked for: :class:`ServeConfig` (the command line's defaults are its own)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PORT = 8000


@dataclass(frozen=True)
class ServeConfig:
    """What ``kvguard serve`` was asked for (the command line's defaults are these).

    Attributes:
        model: embedded model name or local model folder.
        profile: the model's calibration profile.
        host, port: where to listen (loopback by default).
        api_key: require ``Authorization: Bearer KEY`` on every route but ``/healthz``.
        max_batch: sequences decoded together, one model forward per step for all of them; 1 decodes one
            sequence per forward, the others waiting.
        max_queue: requests waiting for the batch; beyond, 429.
        kv_budget: the KV bytes the requests in flight may hold: bytes (``2GiB``, ``512MiB``, ``1000000``) or a
            fraction of the machine's RAM (``0.25``). A request reserves what its plan stores for its prompt and
            ``max_tokens`` (and what the loop may add); one that does not fit waits.
        step_tokens: tokens one forward feeds at most: every decoding sequence's token, then prompt chunks.
        plan: what the requests' caches store: ``profile`` (the profile's plan), ``kvguard@<bytes>`` (a frontier
            plan of the profile) or one tier for every head (``fp16``, ``int8``, ``int4``, ``int3``, ``int2``).
        loop: run the feedback loop over the plan (off: the plan's cache alone).
        max_prompt_tokens: the longest prompt accepted.
        max_new_tokens: the most tokens one request may generate.
        torch_threads: torch threads; 0: the machine's cores.
        log_file: append the JSON log lines here instead of stderr.
        device: where the model runs (``cpu``, ``cuda``, ``auto``; :mod:`kvguard.device`).
        read_timeout: seconds a client may take to send its request body; beyond, 408 (a slow client holds no
            slot: a request is admitted only once its body is in).
    """

    model: str
    profile: str
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    api_key: str | None = None
    max_batch: int = 16
    max_queue: int = 64
    kv_budget: str = "0.25"
    step_tokens: int = 256
    plan: str = "profile"
    loop: bool = True
    max_prompt_tokens: int = 2048
    max_new_tokens: int = 512
    torch_threads: int = 0
    log_file: str | None = None
    device: str = "cpu"
    read_timeout: float = 30.0

    def __post_init__(self) -> None:
        from kvguard.device import Device

        Device(self.device)  # a ValueError listing the valid names
        for name in ("max_batch", "max_prompt_tokens", "max_new_tokens", "step_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {self.max_queue}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.torch_threads < 0:
            raise ValueError(f"--torch-threads must be >= 0, got {self.torch_threads}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key is empty")
        if not self.read_timeout > 0:
            raise ValueError(f"--read-timeout must be > 0 seconds, got {self.read_timeout}")
        kv_budget_bytes(self.kv_budget)  # a ValueError saying what is accepted


_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def kv_budget_bytes(text: str, ram: int | None = None) -> int:
    """``--kv-budget`` in bytes: a byte count with an optional unit (``2GiB``, ``512MiB``, ``1e9``), or a fraction
    in (0, 1] of ``ram`` (default: the machine's RAM, from ``/proc/meminfo`` or ``os.sysconf``)."""
    raw = str(text).strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = float("nan")
    if unit not in _UNITS or not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"--kv-budget must be a byte count (e.g. 2GiB, 512MiB, 1000000000) or a fraction of RAM in "
                         f"(0, 1] (e.g. 0.25), got {text!r}")
    if not unit and value <= 1:
        return int(value * (ram if ram is not None else machine_ram()))
    return int(value * _UNITS[unit])


def machine_ram() -> int:
    """The machine's RAM in bytes."""
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
