"""The merge-or-not decision (scheduling/lora/merge_policy.py): pure cases of its cost model."""

from scheduling.lora.merge_policy import BURST_STEPS, MergeChoice, MergeCosts, MergeMeter, choose_merge

COSTS = MergeCosts(lowrank_s_per_row=0.001, weight_pass_s=0.050, build_s=0.5)


def fits(names: list[str]) -> bool:
    return "huge" not in names and len(names) <= 2  # room for two copies


def test_never_and_no_adapter_merge_nothing():
    assert choose_merge("never", {"a": 16}, 16, {"a"}, fits, 99, COSTS) == MergeChoice()
    assert choose_merge("always", {}, 16, set(), fits, 99, COSTS) == MergeChoice()


def test_always_merges_every_adapter_whose_copy_fits_most_rows_first_building_what_is_missing():
    assert choose_merge("always", {"a": 3, "b": 5}, 10, set(), fits, 0, COSTS) == \
        MergeChoice(("b", "a"), ("b", "a"))
    assert choose_merge("always", {"a": 3, "b": 5}, 10, {"b"}, fits, 0, COSTS) == \
        MergeChoice(("b", "a"), ("a",))
    assert choose_merge("always", {"a": 1, "b": 3, "c": 2}, 9, set(), fits, 0, COSTS) == \
        MergeChoice(("b", "c"), ("b", "c"))  # a third copy does not fit: a stays low-rank
    assert choose_merge("always", {"huge": 4, "a": 1}, 5, set(), fits, 0, COSTS) == \
        MergeChoice(("a",), ("a",))


def test_auto_merges_a_held_copy_only_when_its_rows_low_rank_work_outweighs_a_second_weight_pass():
    # alone in the step: no second pass, any low-rank work is saved
    assert choose_merge("auto", {"a": 1}, 1, {"a"}, fits, 0, COSTS) == MergeChoice(("a",))
    # sharing the step: 40 rows x 1 ms < 50 ms pass; 60 rows > it
    assert choose_merge("auto", {"a": 40}, 48, {"a"}, fits, 0, COSTS) == MergeChoice()
    assert choose_merge("auto", {"a": 60, "b": 2}, 64, {"a"}, fits, 0, COSTS) == MergeChoice(("a",))


def test_auto_builds_only_after_a_burst_whose_savings_pay_for_the_build():
    single = {"a": 16}  # 16 ms saved a step
    assert choose_merge("auto", single, 16, set(), fits, BURST_STEPS - 1, COSTS) == MergeChoice()
    needed = int(COSTS.build_s / 0.016) + 1  # 32 steps of 16 ms pay a 0.5 s build
    assert choose_merge("auto", single, 16, set(), fits, needed - 1, COSTS) == MergeChoice()
    assert choose_merge("auto", single, 16, set(), fits, needed, COSTS) == MergeChoice(("a",), ("a",))
    assert choose_merge("auto", {"huge": 16}, 16, set(), fits, needed, COSTS) == MergeChoice()


def test_the_meter_counts_paying_steps_in_a_row_per_candidate_and_averages_costs():
    meter = MergeMeter(weight_bytes=10**9)
    assert meter.costs().lowrank_s_per_row == 0.0  # unknown: no saving, so no merging on a guess
    assert [meter.paying("a", True) for _ in range(3)] == [1, 2, 3]
    assert meter.paying("b", True) == 1 and meter.paying("b", False) == 0 and meter.paying("b", True) == 1
    meter.observe(lowrank_rows=10, lowrank_s=0.02, num_rows=10, linear_s=0.2)
    assert meter.costs().lowrank_s_per_row == 0.002
    # a big step: no weight-pass sample
    meter.observe(lowrank_rows=10, lowrank_s=0.04, num_rows=500, linear_s=9.0)
    assert 0.002 < meter.costs().lowrank_s_per_row < 0.004 and meter.costs().weight_pass_s < 0.2
