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
