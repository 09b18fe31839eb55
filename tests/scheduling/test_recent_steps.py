"""RecentSteps over an injected clock: the rates count exactly the steps of the last window, over the window
(or the time since the start when shorter), and the stage times are the mean step's."""

import pytest

from scheduling.recent_steps import RecentSteps
from scheduling.step_stats import StageSeconds, StepStats


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def step(generated: int, prefill: int = 0, run: float = 0.0, sample: float = 0.0) -> StepStats:
    return StepStats(num_generated_tokens=generated, num_prefill_tokens=prefill,
                     seconds=StageSeconds(run=run, sample=sample))


def test_rates_cover_the_time_since_the_start_until_a_window_has_passed():
    clock = Clock()
    recent = RecentSteps(clock, window_s=5.0)
    clock.now += 2.0
    recent.add(step(8, prefill=30))
    figures = recent.figures()
    assert (figures.window_s, figures.num_steps) == (2.0, 1)
    assert (figures.tokens_per_s, figures.prompt_tokens_per_s) == (4.0, 15.0)


def test_steps_older_than_the_window_leave_the_rates_and_the_stage_means():
    clock = Clock()
    recent = RecentSteps(clock, window_s=5.0)
    clock.now += 10.0
    recent.add(step(100, run=1.0, sample=0.5))
    clock.now += 3.0
    recent.add(step(4, run=0.2, sample=0.1))
    recent.add(step(6, run=0.4, sample=0.3))
    figures = recent.figures()
    assert figures.num_steps == 3 and figures.tokens_per_s == 110 / 5.0
    assert figures.stage_seconds.run == pytest.approx(1.6 / 3)
    clock.now += 2.5  # the first step is 5.5 s old now
    figures = recent.figures()
    assert figures.num_steps == 2 and figures.tokens_per_s == 10 / 5.0
    stages = figures.stage_seconds
    assert (stages.run, stages.sample) == (pytest.approx(0.3), pytest.approx(0.2))
    assert figures.stage_seconds.schedule == 0.0


def test_an_idle_engine_reports_zero_rates_and_zero_stage_times():
    clock = Clock()
    recent = RecentSteps(clock, window_s=5.0)
    recent.add(step(7, run=0.1))
    clock.now += 60.0
    figures = recent.figures()
    assert (figures.num_steps, figures.tokens_per_s, figures.stage_seconds.total) == (0, 0.0, 0.0)
    assert recent.as_dict()["stage_seconds"] == dict.fromkeys(
        ("schedule", "propose", "run", "sample", "process"), 0.0)
