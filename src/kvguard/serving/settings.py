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
        max_concurrency: requests decoding at once (worker threads).
        max_queue: requests waiting for a worker; beyond, 429.
        max_prompt_tokens: the longest prompt accepted.
        max_new_tokens: the most tokens one request may generate.
        torch_threads: torch threads; 0: the machine's cores shared evenly among the workers.
        log_file: append the JSON log lines here instead of stderr.
        device: where the model runs (``cpu``, ``cuda``, ``auto``; :mod:`kvguard.device`).
    """

    model: str
    profile: str
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    api_key: str | None = None
    max_concurrency: int = 4
    max_queue: int = 32
    max_prompt_tokens: int = 2048
    max_new_tokens: int = 512
    torch_threads: int = 0
    log_file: str | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        from kvguard.device import Device

        Device(self.device)  # a ValueError listing the valid names
        for name in ("max_concurrency", "max_prompt_tokens", "max_new_tokens"):
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
