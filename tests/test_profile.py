"""Profiles: atomic, self-checking, and refused by the wrong model."""

import json

import pytest
import torch

from kvguard.config import MonitorConfig
from kvguard.entropy import EntropyBaseline
from kvguard.plan import LayerPlan, Plan
from kvguard.profile import JSON_NAME, SCHEMA_VERSION, TENSORS_NAME, Profile, ProfileError, ProfileMeta
from tests.helpers import ZERO_FINGERPRINT, profile_meta


def _profile(fingerprint=ZERO_FINGERPRINT) -> Profile:
    plan = Plan((LayerPlan(("int4", "int8"), value_drop=(2, 0)), LayerPlan(("int2", "fp16"), key_clip=0.9)))
    meta = profile_meta(plan, fingerprint=fingerprint, monitor=MonitorConfig())
    tensors = {"calibrated.key.absmax": torch.rand(2, 2, 4) + 0.1, "calibrated.value.absmax": torch.rand(2, 2, 4) + 0.1,
               **EntropyBaseline(*(torch.rand(2, 4, 3) for _ in range(3)), torch.rand(2, 4)).tensors()}
    return Profile(meta, tensors)


def test_values_below_their_keys_are_normalized_and_checked():
    lp = LayerPlan(("int4", "int3", "int8", "int2"), value_drop=(1, 2, 1, 1))
    # INT8 keys keep INT8 values and INT2 has nothing below it: those drops are 0, so equal plans compare equal.
    assert lp.value_drop == (1, 2, 0, 0)
    assert [p.value for p in lp.value_precision] == ["int3", "int2", "int8", "int2"]
    assert LayerPlan(("int8", "int2"), value_drop=(2, 1)) == LayerPlan(("int8", "int2"))
    plan = Plan((lp,))
    assert Plan.from_dict(plan.to_dict()) == plan and plan.to_dict()["layers"][0]["value_drop"] == [1, 2, 0, 0]
    assert plan.summary() == "0:int4/int3/int8/int2[v:int3/int2/int8/int2]"
    with pytest.raises(ValueError, match="value_drop has 1 entries, the layer has 2 KV heads"):
        LayerPlan(("int4", "int4"), value_drop=(1,))
    with pytest.raises(ValueError, match=r"value_drop entries must be in \[0, 2\]"):
        LayerPlan(("int4",), value_drop=(3,))


def test_round_trip(tmp_path):
    p = _profile()
    p.save(tmp_path / "prof")
    q = Profile.load(tmp_path / "prof")
    assert isinstance(q.meta, ProfileMeta)
    assert q.meta == p.meta  # the typed metadata round-trips exactly
    assert q.plan == p.plan
    raw = json.loads((tmp_path / "prof" / JSON_NAME).read_text())
    assert raw["schema_version"] == SCHEMA_VERSION
    assert q.tensors_sha256 == p.tensors_sha256 == raw["tensors_sha256"] and len(q.tensors_sha256) == 64
    assert torch.equal(q.static_scales().key_absmax, p.tensors["calibrated.key.absmax"])
    assert q.meta.monitor.window_tokens == 32 and q.meta.monitor.trigger_consecutive == 3
    # Nothing but the profile is left behind, and saving again replaces it in place.
    p.save(tmp_path / "prof")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["prof"]
    assert sorted(x.name for x in (tmp_path / "prof").iterdir()) == [JSON_NAME, TENSORS_NAME]


def test_failed_write_leaves_the_old_profile(tmp_path, monkeypatch):
    _profile().save(tmp_path / "prof")
    before = (tmp_path / "prof" / JSON_NAME).read_text()
    bad = _profile()
    bad.tensors["broken"] = "not a tensor"
    with pytest.raises(Exception):
        bad.save(tmp_path / "prof")
    assert (tmp_path / "prof" / JSON_NAME).read_text() == before
    assert sorted(x.name for x in tmp_path.iterdir()) == ["prof"]


def test_refuses_to_overwrite_other_directories(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "precious.txt").write_text("keep me")
    with pytest.raises(ProfileError, match="not a kvguard profile"):
        _profile().save(tmp_path / "data")
    assert (tmp_path / "data" / "precious.txt").read_text() == "keep me"


def test_corruption_and_newer_schema_are_clear_errors(tmp_path):
    path = _profile().save(tmp_path / "prof")
    with pytest.raises(ProfileError, match="no profile.json"):
        Profile.load(tmp_path / "missing")
    tensors = path / TENSORS_NAME
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 0xFF
    tensors.write_bytes(bytes(data))
    with pytest.raises(ProfileError, match="corrupted"):
        Profile.load(path)
    path = _profile().save(tmp_path / "prof2")
    meta = json.loads((path / JSON_NAME).read_text())
    meta["schema_version"] = SCHEMA_VERSION + 1
    (path / JSON_NAME).write_text(json.dumps(meta))
    with pytest.raises(ProfileError, match="newer"):
        Profile.load(path)
    (path / JSON_NAME).write_text("{ not json")
    with pytest.raises(ProfileError, match="corrupted"):
        Profile.load(path)


@pytest.mark.slow
def test_refuses_another_model(tmp_path, smollm2):
    model, _ = smollm2
    path = _profile().save(tmp_path / "prof")
    with pytest.raises(ProfileError, match="fingerprint"):
        Profile.load(path, model)
