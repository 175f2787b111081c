"""Filling starting packs with the items a plan deferred: longest first, each to the pack that then
ends earliest, only where it fits."""

from __future__ import annotations

from plora_hpo.planner.fill import spread_deferred


def test_the_longest_deferred_item_goes_first_to_the_pack_that_then_ends_earliest():
    steps = [10, 10, 50, 30, 5]  # items 0 and 1 start; 2, 3 and 4 were deferred
    packs = [[1], [0]]

    def seconds(k: int, items: list[int]) -> float:
        return max(steps[i] for i in items) + 0.5 * k  # pack 1 runs a little slower

    def fits(_: int, items: list[int]) -> bool:
        return len(items) <= 2

    placed = spread_deferred(packs, [4, 3, 2], steps, fits=fits, seconds=seconds)
    # 2 (50 steps) ends pack 0 at 50 and pack 1 at 50.5: pack 0; 3 finds pack 0 full: pack 1; 4 fits nowhere
    assert placed == [2, 3]
    assert packs == [[1, 2], [0, 3]]


def test_nothing_moves_when_nothing_fits():
    packs = [[0]]
    placed = spread_deferred(packs, [1], [5, 5], fits=lambda k, items: False, seconds=lambda k, items: 1.0)
    assert placed == [] and packs == [[0]]
