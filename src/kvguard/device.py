"""Where a model runs: ``--device cpu | cuda | auto``, resolved to a ``torch.device`` once, before any work.

    device.resolve("auto")      # torch.device("cuda") when torch sees a GPU, else torch.device("cpu")
    device.resolve("cuda")      # DeviceUnavailableError at once on a machine without one

Everything that loads a model takes one of these (``kvguard.models.load(..., device=...)``); everything after
that follows the model (``ids.to(model.device)``, caches built on the device of the first K/V they store).
"""

from __future__ import annotations

from enum import Enum

import torch


class Device(str, Enum):
    """A device choice as the command line and the configs spell it."""

    CPU = "cpu"  # always available
    CUDA = "cuda"  # the current CUDA GPU; refused at once when torch sees none
    AUTO = "auto"  # cuda when torch sees a GPU, else cpu

    @classmethod
    def _missing_(cls, value):
        raise ValueError(f"device has to be one of [{', '.join(d.value for d in cls)}] but got {value!r}")


class DeviceUnavailableError(ValueError):
    """``cuda`` was asked for and torch sees no CUDA GPU (a ``ValueError``: the command line prints one line)."""


def resolve(device: Device | str | torch.device = Device.AUTO) -> torch.device:
    """The ``torch.device`` for a choice; a ``torch.device`` (``cuda:1``) passes through once it is checked.

    Raises:
        ValueError: an unknown name (the message lists the valid ones).
        DeviceUnavailableError: ``cuda`` on a machine where torch sees no GPU (the message says the fix).
    """
    if isinstance(device, torch.device):
        chosen = device
    else:
        choice = Device(device)
        if choice is Device.AUTO:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        chosen = torch.device(choice.value)
    if chosen.type == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise DeviceUnavailableError(
            f"device 'cuda' was asked for, but torch sees no CUDA GPU here (torch {torch.__version__}, {build}); "
            f"use --device cpu (or auto, which picks cuda only where there is one), or run on a machine with an "
            f"NVIDIA GPU and a CUDA build of torch")
    return chosen


def name(device: Device | str | torch.device) -> str:
    """The resolved device as text (``cpu``, ``cuda``, ``cuda:1``): what configs and subprocesses pass on."""
    return str(resolve(device))
