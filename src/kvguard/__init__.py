"""kvguard: calibrated KV-cache quantization with real-time error compensation."""

__version__ = "0.1.0"
