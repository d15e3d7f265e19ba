"""The policy as a pure state machine: hand-made windows in, decisions out; no model anywhere."""

from dataclasses import replace

import pytest

from kvguard.config import Demotion, MonitorConfig
from kvguard.control.policy import (MAX_LEVEL, Action, Alarm, PolicyState, Window, decide, raw_alarms)
from kvguard.precision import Precision

CFG = MonitorConfig()
INT4, INT2, INT8, FP16 = Precision.INT4, Precision.INT2, Precision.INT8, Precision.FP16


def _state(tiers=((INT4, INT4), (INT2, INT4), (INT4, INT4))) -> PolicyState:
    return PolicyState.initial(tiers)


def _window(drop=(0.0, 0.0, 0.0), consecutive=(0, 0, 0), monitored=(True, True, True), risk=None, nonfinite=False):
    return Window(tuple(drop), tuple(consecutive), tuple(monitored), None if risk is None else tuple(risk), nonfinite)


def _actions(step):
    return [(d.action, d.alarm, d.layers) for d in step.decisions]


def test_quiet_window_does_nothing():
    step = decide(CFG, _state(), _window())
    assert step.decisions == () and not step.acted and step.state.level == 0
    assert step.state.steps_since_severe == 1 and step.state.recent == (False,)


def test_warning_compensates_light_once_per_episode_and_rearms_below_half():
    state = _state()
    step = decide(CFG, state, _window(drop=(0.0, 0.21, 0.0)))
    assert _actions(step) == [(Action.LIGHT, Alarm.WARNING, (1,))] and step.warning and step.acted
    d = step.decisions[0]
    assert (d.fraction, d.cap, d.level) == (0.02, 0.05, 0)
    again = decide(CFG, step.state, _window(drop=(0.0, 0.21, 0.0)))  # same episode: no new action
    assert again.decisions == () and not again.acted
    calm = decide(CFG, again.state, _window(drop=(0.0, 0.09, 0.0)))  # under warn_drop / 2: re-armed
    assert calm.state.armed[1]
    assert _actions(decide(CFG, calm.state, _window(drop=(0.0, 0.3, 0.0)))) == [(Action.LIGHT, Alarm.WARNING, (1,))]


def test_with_a_classifier_warnings_act_only_where_the_risk_makes_quantization_a_plausible_cause():
    quiet_risk = _window(drop=(0.0, 0.21, 0.0), consecutive=(0, 0, 4), risk=(0.1, 0.3, 0.2))
    step = decide(CFG, _state(), quiet_risk)
    assert step.decisions == () and not step.acted and not step.warning
    assert step.state.armed == (True, True, True)  # not spent: the episode may still act once the risk rises
    risky = decide(CFG, step.state, _window(drop=(0.0, 0.21, 0.0), consecutive=(0, 0, 4), risk=(0.1, 0.6, 0.2)))
    assert _actions(risky) == [(Action.LIGHT, Alarm.WARNING, (1,))]
    severe = decide(CFG, _state(), _window(drop=(0.0, 0.4, 0.0), risk=(0.0, 0.0, 0.0)))
    assert severe.severe and severe.state.level == 1  # a severe drop acts whatever the risk


def test_trigger_needs_the_consecutive_run_and_unmonitored_layers_never_alarm():
    assert decide(CFG, _state(), _window(consecutive=(2, 0, 0))).decisions == ()
    step = decide(CFG, _state(), _window(consecutive=(3, 0, 3)))
    assert _actions(step) == [(Action.LIGHT, Alarm.TRIGGER, (0, 2))] and step.trigger and not step.warning
    off = decide(CFG, _state(), _window(drop=(0.5, 0.5, 0.0), consecutive=(9, 9, 0), monitored=(False, False, True)))
    assert off.decisions == () and not off.acted


def test_severe_climbs_the_ladder_with_heavy_compensation_up_to_the_worst_layer():
    cfg = MonitorConfig(heavy_layers=2)
    step = decide(cfg, _state(), _window(drop=(0.4, 0.36, 0.5)))
    assert _actions(step) == [(Action.ROLLBACK_INT8, Alarm.SEVERE, (2,)), (Action.HEAVY, Alarm.SEVERE, (1, 2))]
    assert step.severe and not step.warning and step.state.level == 1
    heavy = step.decisions[1]
    assert (heavy.fraction, heavy.cap, heavy.level) == (0.04, 0.10, 1)  # level 1 doubles the shares
    assert step.state.effective(0) == (INT8, INT8) and step.state.effective(1) == (INT8, INT8)
    second = decide(cfg, step.state, _window(drop=(0.0, 0.0, 0.4)))
    assert _actions(second) == [(Action.ROLLBACK_WIDEN, Alarm.SEVERE, (2,)), (Action.HEAVY, Alarm.SEVERE, (0, 1, 2))]
    third = decide(cfg, second.state, _window(drop=(0.0, 0.0, 0.4)))
    assert _actions(third) == [(Action.ROLLBACK_FULL, Alarm.SEVERE, (2,))] and third.state.level == MAX_LEVEL
    assert all(third.state.effective(l) == (FP16, FP16) for l in range(3))
    hold = decide(cfg, third.state, _window(drop=(0.0, 0.0, 0.4)))
    assert _actions(hold) == [(Action.HOLD_FULL, Alarm.SEVERE, (2,))] and hold.state.level == MAX_LEVEL


def test_nonfinite_reading_is_severe_on_the_last_layer():
    step = decide(CFG, _state(), _window(nonfinite=True))
    assert step.decisions[0].action is Action.ROLLBACK_INT8 and step.decisions[0].alarm is Alarm.NONFINITE
    assert step.decisions[0].layers == (2,) and step.decisions[1].layers == (0, 1, 2)


def test_the_ladder_steps_down_after_doubling_quiet_spells_and_restores_the_plan():
    cfg = MonitorConfig(cooldown_steps=2)
    state = _state()
    for _ in range(3):
        state = decide(cfg, state, _window(drop=(0.5, 0.0, 0.0))).state
    assert state.level == 3
    levels = []
    for _ in range(2 * 4 + 2 * 2 + 2 * 1):
        step = decide(cfg, state, _window())
        state = step.state
        levels.append(state.level)
        if step.decisions:
            assert step.decisions[0].action is Action.STEP_DOWN and step.decisions[0].alarm is Alarm.COOLDOWN
    assert levels == [3] * 7 + [2] * 4 + [1] * 2 + [0]  # 2 * 4, then 2 * 2, then 2 * 1 quiet steps
    assert state.tiers == state.floor


def test_risk_promotes_after_promote_steps_within_one_tier_and_demotes_slowly():
    cfg = MonitorConfig(promote_steps=2, demotion="risk", demote_steps=2, max_promotion_tiers=1)
    state = _state()
    high = _window(risk=(0.95, 0.6, 0.1))
    first = decide(cfg, state, high)
    assert first.decisions == ()
    second = decide(cfg, first.state, high)
    # Layer 0 is above promote_risk; layer 1 above promote_layer_risk while layer 0 is there.
    assert _actions(second) == [(Action.PRECISION_UP, Alarm.RISK, (0,)), (Action.LIGHT, Alarm.RISK, (0,)),
                                (Action.PRECISION_UP, Alarm.RISK, (1,)), (Action.LIGHT, Alarm.RISK, (1,))]
    assert second.decisions[1].fraction == second.decisions[1].cap == 0.05  # a promotion recomputes its whole share
    assert second.state.tiers[0] == (INT8, INT8) and second.state.tiers[1] == (INT4, INT8)
    capped = decide(cfg, decide(cfg, second.state, high).state, high)
    assert capped.state.tiers[0] == (INT8, INT8)  # at most one tier above the plan
    state, downs = capped.state, []
    for _ in range(12):
        step = decide(cfg, state, _window(risk=(0.1, 0.1, 0.1)))
        state = step.state
        downs += [d.layers[0] for d in step.decisions if d.action is Action.PRECISION_DOWN]
    assert state.tiers == state.floor and downs == [0, 1]
    assert state.demotions[:2] == (1, 1)


def test_by_default_a_promotion_stays_through_low_risk_and_goes_back_only_over_the_budget():
    cfg = MonitorConfig(promote_steps=1, demote_steps=2)
    assert cfg.demotion is Demotion.BUDGET
    state = decide(cfg, _state(), _window(risk=(0.95, 0.1, 0.1))).state
    assert state.tiers[0] == (INT8, INT8)
    for _ in range(40):  # far past demote_steps * 2**demotions of the risk rule
        step = decide(cfg, state, _window(risk=(0.0, 0.0, 0.0)))
        assert step.decisions == () and not step.acted
        state = step.state
    assert state.tiers[0] == (INT8, INT8)
    over = Window((0.0,) * 3, (0,) * 3, (True,) * 3, (0.0, 0.0, 0.0), headroom=-0.01)
    step = decide(cfg, state, over)
    assert _actions(step) == [(Action.PRECISION_DOWN, Alarm.BUDGET, (0,))] and step.state.tiers == step.state.floor


def test_promotions_wait_for_headroom_and_over_budget_the_least_risky_promoted_layer_steps_down():
    cfg = MonitorConfig(promote_steps=1)
    high = (0.95, 0.95, 0.1)
    full = decide(cfg, _state(), Window((0.0,) * 3, (0,) * 3, (True,) * 3, high, headroom=0.0))
    assert full.decisions == () and not full.acted  # no room: nothing is promoted
    room = decide(cfg, _state(), Window((0.0,) * 3, (0,) * 3, (True,) * 3, high, headroom=0.05))
    assert [d.layers for d in room.decisions if d.action is Action.PRECISION_UP] == [(0,), (1,)]
    over = Window((0.0,) * 3, (0,) * 3, (True,) * 3, (0.95, 0.92, 0.1), headroom=-0.01)
    step = decide(cfg, room.state, over)
    assert _actions(step) == [(Action.PRECISION_DOWN, Alarm.BUDGET, (1,))] and step.acted
    assert step.state.tiers[1] == step.state.floor[1] and step.state.tiers[0] == (INT8, INT8)
    step = decide(cfg, step.state, over)
    assert _actions(step) == [(Action.PRECISION_DOWN, Alarm.BUDGET, (0,))]
    assert step.state.tiers == step.state.floor
    assert decide(cfg, step.state, over).decisions == ()  # nothing left to demote


def test_over_budget_during_the_rollback_ladder_keeps_promotions_that_would_free_nothing():
    cfg = MonitorConfig(promote_steps=1)
    promoted = decide(cfg, _state(), Window((0.0,) * 3, (0,) * 3, (True,) * 3, (0.95, 0.95, 0.1), headroom=0.05))
    assert promoted.state.tiers[:2] == ((INT8, INT8), (INT4, INT8))
    # A severe drop lifts every layer to INT8 for new tokens: a step-down below INT8 would change nothing stored.
    severe = decide(cfg, promoted.state, Window((0.0, 0.0, 0.5), (0,) * 3, (True,) * 3, (0.1,) * 3, headroom=-0.01))
    assert severe.state.level == 1
    assert not any(d.action is Action.PRECISION_DOWN for d in severe.decisions)
    assert severe.state.tiers == promoted.state.tiers
    # Promoted to FP16 (two tiers over an INT4 plan), a step-down to INT8 does free bytes at level 1.
    plan = PolicyState.initial(((INT4, INT4),) * 3)
    fp16 = replace(plan, tiers=((FP16, FP16),) + plan.floor[1:], level=1)
    down = decide(cfg, fp16, Window((0.0,) * 3, (0,) * 3, (True,) * 3, (0.1,) * 3, headroom=-0.01))
    assert _actions(down) == [(Action.PRECISION_DOWN, Alarm.BUDGET, (0,))] and down.state.tiers[0] == (INT8, INT8)


def test_priced_promotions_go_riskiest_first_as_far_as_the_room_goes_and_the_rest_wait():
    cfg = MonitorConfig(promote_steps=1)
    risk = (0.92, 0.95, 0.91)  # layer 1 first, then 0, then 2
    # One bit in one head costs 0.01 of the FP16 bytes: INT4 -> INT8 on two heads costs 0.08, INT2 -> INT4 and
    # INT4 -> INT8 on layer 1's heads 0.06.
    def window(headroom):
        return Window((0.0,) * 3, (0,) * 3, (True,) * 3, risk, headroom=headroom, bit_cost=(0.01,) * 3)

    step = decide(cfg, _state(), window(0.10))
    assert [d.layers for d in step.decisions if d.action is Action.PRECISION_UP] == [(1,)]  # layer 0 (0.08) waits
    assert step.state.high[0] >= 1 and step.state.tiers[0] == step.state.floor[0]
    assert not any(d.action is Action.PRECISION_DOWN for d in step.decisions)
    more = decide(cfg, step.state, window(0.08))  # room again: the waiting layer goes first, then none fits
    assert [d.layers for d in more.decisions if d.action is Action.PRECISION_UP] == [(0,)]
    unpriced = decide(cfg, _state(), Window((0.0,) * 3, (0,) * 3, (True,) * 3, risk, headroom=0.10))
    assert [d.layers for d in unpriced.decisions if d.action is Action.PRECISION_UP] == [(1,), (0,), (2,)]
    with pytest.raises(ValueError, match="one entry per layer"):
        Window((0.0,) * 3, (0,) * 3, (True,) * 3, risk, bit_cost=(0.01,) * 2)


def test_the_prompt_check_promotes_a_layer_at_risk_at_once():
    cfg = MonitorConfig(promote_steps=2)
    risk = (0.95, 0.1, 0.1)
    plain = decide(cfg, _state(), Window((0.0,) * 3, (0,) * 3, (True,) * 3, risk))
    assert plain.decisions == ()  # hysteresis: a second step is needed
    check = decide(cfg, _state(), Window((0.0,) * 3, (0,) * 3, (True,) * 3, risk, prompt=True))
    assert _actions(check)[:2] == [(Action.PRECISION_UP, Alarm.RISK, (0,)), (Action.LIGHT, Alarm.RISK, (0,))]


def test_trigger_rate_recommends_recalibration_once():
    cfg = MonitorConfig(trigger_rate_steps=40, max_trigger_rate=0.05)
    state, recommended = _state(), 0
    for i in range(60):
        drop = (0.3, 0.0, 0.0) if i % 2 == 0 else (0.0, 0.0, 0.0)  # an alarm every other step, re-armed between
        step = decide(cfg, state, _window(drop=drop))
        state = step.state
        recommended += sum(d.action is Action.RECOMMEND_RECALIBRATION for d in step.decisions)
    assert recommended == 1 and state.recalibration_recommended and len(state.recent) == 40
    assert state.trigger_rate == pytest.approx(0.5)


def test_raw_alarms_are_the_rules_without_episodes():
    flags = raw_alarms(CFG, (0.2, 0.36, 0.1), (0, 3, 2), (True, True, False))
    assert flags.warning == (True, True, False) and flags.severe == (False, True, False)
    assert flags.trigger == (False, True, False)


def test_bad_evidence_is_refused():
    with pytest.raises(ValueError, match="one entry per layer"):
        Window((0.0, 0.0), (0,), (True, True))
    with pytest.raises(ValueError, match="layers"):
        decide(CFG, _state(), Window((0.0,), (0,), (True,)))
