import pytest

from kvguard.evaluation import methods, passkey


@pytest.mark.parametrize("reply, ok", [(" 12345.", True), ("12345 is the key", True), (" 1234", False), ("none", False),
                                       (" 54321 or 12345", False)])
def test_answer_check(reply, ok):
    assert passkey.is_correct(reply, "12345") is ok


@pytest.mark.slow
def test_prompt_layout(smollm2):
    _, tok = smollm2
    ids, key = passkey.build_prompt(tok, 512, 0.5, seed=3)
    assert ids.numel() == 512 and len(key) == 5
    text = tok.decode(ids)
    assert text.count(key) == 2 and text.endswith("The pass key is") and "<|im_start|>user" in text
    assert 0.35 < text.index(key) / len(text) < 0.65
    again, key2 = passkey.build_prompt(tok, 512, 0.5, seed=3)
    assert key2 == key and again.tolist() == ids.tolist()
    with pytest.raises(ValueError, match="too short"):
        passkey.build_prompt(tok, 20, 0.5, seed=0)


@pytest.mark.slow
def test_fp16_and_int8_find_a_passkey_in_a_short_prompt(smollm2):
    # SmolLM2-135M retrieves reliably only up to ~512 tokens of Shakespeare filler (benchmarks/README.md).
    model, tok = smollm2
    for name in ("fp16", "int8"):
        results = passkey.run(model, tok, methods.get(name), [512], [0.5], trials=2, progress=False)
        assert results[0].trials == 2 and results[0].accuracy == 1.0
