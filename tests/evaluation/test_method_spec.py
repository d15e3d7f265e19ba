"""Method names parsed once: the spec of each kind of name, and the errors that name the valid values."""

import pytest

from kvguard.evaluation import methods
from kvguard.evaluation.method_spec import KVGUARD, LIVE, MODIFIERS, MethodSpec, Modifier, parse
from tests.evaluation.test_methods import TINY


def test_names_parse_into_their_spec():
    assert parse("int4") == MethodSpec("int4", "int4")
    assert parse("int4+rot+v1") == MethodSpec("int4+rot+v1", "int4", modifiers=(Modifier.ROT, Modifier.V1))
    assert parse("kvguard") == MethodSpec("kvguard", KVGUARD)
    assert parse("kvguard@.25+nosb") == MethodSpec("kvguard@.25+nosb", KVGUARD, 0.25, (Modifier.NOSB,))
    assert parse("kvguard@0.28/p99+rot") == MethodSpec("kvguard@0.28/p99+rot", KVGUARD, 0.28, (Modifier.ROT,), tail=True)
    assert parse("fp8:head") == MethodSpec("fp8:head", "fp8:head")  # the registry says what it is
    assert parse(LIVE) == MethodSpec(LIVE, LIVE, live=True, over=MethodSpec(KVGUARD, KVGUARD))
    live = parse("kvguard-live:kvguard@0.3+rot")
    assert live.live and live.over == MethodSpec("kvguard@0.3+rot", KVGUARD, 0.3, (Modifier.ROT,))
    assert [parse(n).needs_profile for n in ("kvguard", "kvguard@0.2", LIVE, "kvguard-live:int2", "int2", "fp8")] == [
        True, True, True, True, False, False]
    assert parse("int4+rot+v1").prefix(0) == "int4" and parse("int4+rot+v1").prefix(1) == "int4+rot"


def test_grammar_errors_name_the_valid_values():
    with pytest.raises(ValueError, match=r"'int4\+v3': unknown modifier 'v3'; valid modifiers are \[rot, rotk"):
        parse("int4+v3+rot")
    assert MODIFIERS == tuple(m.value for m in Modifier) and "prerope" in MODIFIERS
    with pytest.raises(ValueError, match=r"'kvguard@abc': expected kvguard@<bytes ratio>\[/p99\], e.g. kvguard@0.25"):
        parse("kvguard@abc+rot")
    with pytest.raises(ValueError, match=r"'kvguard@0.2/p90': expected kvguard@<bytes ratio>\[/p99\]"):
        parse("kvguard@0.2/p90")
    with pytest.raises(ValueError, match=r"only kvguard@<bytes> ranks by the tail"):
        MethodSpec("kvguard/p99", KVGUARD, tail=True)
    with pytest.raises(ValueError, match="not over another live one"):
        parse("kvguard-live:kvguard-live")
    with pytest.raises(ValueError, match="only kvguard@<bytes> takes a budget"):
        MethodSpec("int4@0.2", "int4", 0.2)


def test_the_registry_refuses_what_it_does_not_hold():
    with pytest.raises(ValueError, match=r"unknown method 'int9'; valid methods are \[fp16, int8, .*kvguard@<bytes>"):
        methods.get("int9+rot")
    with pytest.raises(ValueError, match=r"'hf-quanto-2\+sb': \+sb applies to a static kvguard plan; 'hf-quanto-2'"):
        methods.get("hf-quanto-2+sb+rot")
    with pytest.raises(ValueError, match="needs a calibration profile: pass --profile"):
        methods.get("kvguard-live:int2")
    with pytest.raises(ValueError, match=r"'fp8' needs a calibration profile: .*`kvguard export` writes"):
        methods.get("fp8")


def test_modifiers_apply_left_to_right_and_name_each_step():
    method = methods.get("int4+rot+v1")
    assert method.name == "int4+rot+v1"
    assert method.description.endswith("; Hadamard-rotated keys and values; values 1 tier below their keys'")
    assert method.plan(TINY) == methods.get("int4").plan(TINY).with_rotation(True, True).with_value_drop(1)
