import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Bit-for-bit checks across thread counts (calibration on Ray workers with 1 torch thread against this process's
# 2, tests/calibration/test_distributed.py) need MKL's strict reproducibility mode on CPUs where MKL splits some
# float32 matmuls (SmolLM2's MLP down_proj on 4 x 25 tokens) by thread count. MKL reads it once, when torch first
# calls it: set here, before any test module imports torch; Ray workers inherit the environment.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
# Triton's interpreter for tests/test_triton_attention.py (no GPU here or in CI). It must be set before anything
# imports triton.language (transformers does, through torch._dynamo, when hqq is installed): Triton decorates its
# own library functions then, and an interpreted kernel cannot call compiled ones. Only Triton reads it, and no
# other test launches a Triton kernel.
os.environ.setdefault("TRITON_INTERPRET", "1")


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
def qwen25():
    """The real Qwen2.5-Coder-0.5B-Instruct, (model, tokenizer), float32 on CPU: the model whose key outliers
    break KV quantization."""
    from kvguard import models

    return models.load("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def small_profile_dir(tmp_path_factory, smollm2):
    """The directory of a small calibrated SmolLM2 profile (shared, read-only)."""
    from kvguard.calibration.pipeline import calibrate
    from tests.helpers import small_config

    out = tmp_path_factory.mktemp("cal") / "profile"
    calibrate(small_config(out), progress=False)
    return out


@pytest.fixture(scope="session")
def smollm2_4_layers(tmp_path_factory):
    """SmolLM2-135M's first 4 decoder layers, its embeddings, norm and head, as a model folder: real weights and
    text for calibration runs that have to be repeated (a run takes a fraction of the 30-layer model's)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kvguard import models

    layers = 4
    source = models.resolve("smollm2-135m")
    config = AutoConfig.from_pretrained(source)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    out = tmp_path_factory.mktemp("smollm2-4-layers")
    AutoModelForCausalLM.from_pretrained(source, config=config).save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def gemma3_6_layers():
    """Gemma 3 270M's first 6 decoder layers (5 sliding, 1 full) with the sliding window cut from 512 to 128
    tokens, (model, tokenizer): real weights and text that run past a sliding window in a third of the tokens
    and layers the whole model needs."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvguard import models

    layers = 6
    source = models.resolve("gemma3-270m")
    config = AutoConfig.from_pretrained(source)
    config.num_hidden_layers = layers
    config.layer_types = config.layer_types[:layers]
    config.sliding_window = 128
    model = AutoModelForCausalLM.from_pretrained(source, config=config, dtype=torch.float32)
    return model.eval(), models.load_tokenizer(source)
