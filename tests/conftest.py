import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Bit-for-bit checks across thread counts (calibration on Ray workers with 1 torch thread against this process's
# 2, tests/calibration/test_distributed.py) need MKL's strict reproducibility mode on CPUs where MKL splits some
# float32 matmuls (SmolLM2's MLP down_proj on 4 x 25 tokens) by thread count. MKL reads it once, when torch first
# calls it: set here, before any test module imports torch; Ray workers inherit the environment.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct, (model, tokenizer), float32 on CPU."""
    from kvguard import models

    return models.load("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3():
    """The real Gemma 3 270M, (model, tokenizer), float32 on CPU."""
    from kvguard import models

    return models.load("gemma3-270m")


@pytest.fixture(scope="session")
def small_profile_dir(tmp_path_factory, smollm2):
    """The directory of a small calibrated SmolLM2 profile (shared, read-only)."""
    from kvguard.calibration.pipeline import calibrate
    from tests.helpers import small_config

    out = tmp_path_factory.mktemp("cal") / "profile"
    calibrate(small_config(out), progress=False)
    return out
