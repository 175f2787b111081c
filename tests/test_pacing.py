"""SharePacer: the share of wall time a side job (checkpoint saves, live curves) may take."""

from plora_hpo.pacing import SharePacer


def test_first_save_is_the_measurement_then_saves_wait_for_their_share(clock):
    pacer = SharePacer(0.1, clock=clock)
    assert pacer.affordable(1_000_000)  # nothing measured yet
    clock.now += 10
    pacer.record(1_000_000, 2.0)  # 2 s per million parameters
    # After 10 s, 2 s spent: another 2 s save would make 4 s > 10% of 10 s.
    assert not pacer.affordable(1_000_000)
    clock.now += 29  # 39 s elapsed: 2 + 2 = 4 > 3.9
    assert not pacer.affordable(1_000_000)
    clock.now += 2  # 41 s: 4 <= 4.1
    assert pacer.affordable(1_000_000)
    # A quarter of the size costs a quarter of the time: 2 + 0.5 <= 4.1.
    assert pacer.affordable(250_000)


def test_cheap_saves_are_always_affordable(clock):
    pacer = SharePacer(0.1, clock=clock)
    for _ in range(20):
        clock.now += 5.0
        assert pacer.affordable(10_000)
        pacer.record(10_000, 0.01)
