import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


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


# A small real calibration of SmolLM2 (seconds, not minutes). Latency does not enter the score (beta 0): the
# tests are about the pipeline and the profile's use, and latency is measured separately.
def small_config(out, **kw):
    from kvguard.calibrate import CalibrationConfig
    from kvguard.search import Objective

    settings = dict(samples=8, domains=("prose", "code"), max_tokens=64, batch_size=4, heldout_tokens=512,
                    context=512, head_layers=1, latency_context=128,
                    objective=Objective(beta=0.0, memory_budget=0.40, max_ppl_increase=2.0))
    settings.update(kw)
    return CalibrationConfig("smollm2-135m", out, **settings)


@pytest.fixture(scope="session")
def small_profile_dir(tmp_path_factory, smollm2):
    """The directory of a small calibrated SmolLM2 profile (shared, read-only)."""
    from kvguard.calibrate import calibrate

    out = tmp_path_factory.mktemp("cal") / "profile"
    calibrate(small_config(out), progress=False)
    return out
