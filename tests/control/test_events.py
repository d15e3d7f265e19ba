from kvguard.control.events import Event, describe, layer_ranges
from kvguard.control.policy import Action, Alarm


def _event(**kw) -> Event:
    base = dict(time=0.0, sequence="s", token=412, alarm=Alarm.TRIGGER, action=Action.HEAVY, level=0, layers=(3, 4, 5, 9),
                entropy=(1.0,) * 4, baseline=(2.0,) * 4, drop=(0.5,) * 4, risk=None)
    return Event(**{**base, **kw})


def test_layer_ranges_join_runs():
    assert layer_ranges([9, 3, 4, 5, 4]) == "3-5, 9" and layer_ranges([7]) == "7" and layer_ranges([]) == ""


def test_describe_tells_what_the_loop_did():
    line = describe(_event(positions=96, ms=12.4).to_json())
    assert line == "token   412  trigger      -> heavy on layers 3-5, 9: 96 positions recomputed (12 ms)"
    up = describe(_event(action=Action.PRECISION_UP, alarm=Alarm.RISK, layers=(2,), precision=("int8", "int4", "int8")).to_json())
    assert up.endswith("-> precision_up on layer 2: now int4/int8")
    rollback = describe(_event(action=Action.ROLLBACK_INT8, level=1, previous_level=0, layers=()).to_json())
    assert rollback.endswith("-> rollback_int8_double_recompute; rollback level 0 -> 1")
