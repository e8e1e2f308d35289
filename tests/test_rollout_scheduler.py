"""The rollout's slot scheduler alone (no engine, no model): admission into the lowest free
slots, pauses, parking only when samples wait for a slot (the latest paused first, and only
after a whole chunk unless no slot decodes), parked samples back ahead of queued ones, finishes,
and its counters; then random event sequences against the invariants."""

import random

import numpy as np
import pytest

from jaxrl_tools.rollout.scheduler import SlotScheduler


def test_admits_queued_samples_into_the_lowest_free_slots():
    s = SlotScheduler(num_samples=5, slots=3)
    assert s.busy and s.admit() == [(0, 0), (1, 1), (2, 2)]
    assert s.admit() == [] and list(s.queue) == [3, 4]
    assert s.active().tolist() == [True, True, True]
    s.finish(1)
    s.finish(0)
    assert s.slot(0) == -1 and s.active().tolist() == [False, False, True]
    assert s.admit() == [(3, 0), (4, 1)]  # lowest slot first, whatever order they freed in
    assert s.max_in_flight == 3
    for i in (2, 3, 4):
        s.finish(i)
    assert not s.busy


def test_a_paused_sample_keeps_its_slot_without_decoding():
    s = SlotScheduler(num_samples=2, slots=2)
    s.admit()
    s.pause(1)
    assert s.is_paused(1) and s.active().tolist() == [True, False]
    assert s.to_park() == []  # nothing waits for a slot
    assert s.resolve(1) is True  # in its slot: append its observation now
    assert s.active().tolist() == [True, True]


def test_parks_only_for_waiting_samples_after_a_whole_chunk_latest_first():
    s = SlotScheduler(num_samples=6, slots=3)
    s.admit()
    s.decoded()
    s.pause(2)  # paused after chunk 1
    s.decoded()
    s.pause(0)  # paused after chunk 2
    s.pause(1)
    # All three paused, none decodes: any paused one may go, even one paused just now.
    assert s.to_park() == [(0, 0), (1, 1), (2, 2)]  # latest paused first, then by slot
    s.resolve(0)
    s.resolve(1)
    s.decoded()  # (a chunk with nothing active does not happen; counted for the rule)
    s.pause(0)
    # Slot 1 decodes: only samples paused before the last chunk may park (sample 2).
    assert s.to_park() == [(2, 2)]


def test_park_is_bounded_by_the_samples_that_want_a_slot_and_max_parked():
    s = SlotScheduler(num_samples=4, slots=3, max_parked=1)
    s.admit()
    for i in range(3):
        s.pause(i)
    s.decoded()
    assert s.to_park() == [(0, 0)]  # one queued sample wants a slot
    s.park(0, "row0")
    assert s.is_parked(0) and s.slot(0) == -1 and s.num_parked == 1
    assert s.admit() == [(3, 0)]
    assert s.max_in_flight == 4 and s.parks == 1
    s.finish(3)
    s.queue.append(99)  # another sample waits: max_parked=1 is reached
    assert s.to_park() == []
    assert SlotScheduler(2, 1, max_parked=0).to_park() == []


def test_a_parked_sample_comes_back_first_into_the_first_free_slot():
    s = SlotScheduler(num_samples=4, slots=2)
    s.admit()
    s.pause(0)
    s.decoded()
    s.decoded()
    assert s.to_park() == [(0, 0)]
    s.park(0, "row0")
    assert s.admit() == [(2, 0)]
    assert s.resolve(0) is False  # its result arrived while parked: waits for a slot
    assert s.unpark() == []  # no slot free
    s.finish(1)
    assert s.unpark() == [(0, 1, "row0")]  # ahead of queued sample 3
    assert s.admit() == [] and s.slot(0) == 1 and not s.is_parked(0)
    assert s.active().tolist() == [True, True]


def test_finishing_a_parked_sample_drops_its_row():
    s = SlotScheduler(num_samples=3, slots=1)
    s.admit()
    s.pause(0)
    s.decoded()
    s.park(0, "row0")
    s.finish(0)
    assert not s.is_parked(0) and s.num_parked == 0
    assert s.admit() == [(1, 0)]


@pytest.mark.parametrize("seed", range(20))
def test_random_events_keep_every_sample_in_exactly_one_place(seed):
    rng = random.Random(seed)
    n, slots = rng.randint(1, 12), rng.randint(1, 4)
    s = SlotScheduler(n, slots, max_parked=rng.choice([None, 0, 1, 3]))
    finished: set[int] = set()
    for _ in range(400):
        for i, slot, row in s.unpark():
            assert row == f"row{i}" and s.slot(i) == slot
        s.admit()
        active = s.active()
        assert active.sum() == sum(not s.is_paused(i) for i in s.running.values())
        if active.any():
            s.decoded()
        for slot in np.nonzero(active)[0].tolist():
            i = s.running[slot]
            event = rng.random()
            if event < 0.2:
                s.finish(i)
                finished.add(i)
            elif event < 0.5:
                s.pause(i)
        for i in [i for i in range(n) if s.is_paused(i)]:
            event = rng.random()
            if event < 0.3:
                s.resolve(i)
            elif event < 0.4:
                s.finish(i)
                finished.add(i)
        for i, slot in s.to_park():
            assert s.is_paused(i) and s.running[slot] == i
            s.park(i, f"row{i}")
        # Every sample is queued, in one slot, parked, or finished; never two of these.
        in_slots = list(s.running.values())
        assert len(in_slots) == len(set(in_slots)) <= slots
        assert s.num_parked <= s.max_parked
        for i in range(n):
            places = [i in s.queue, i in in_slots, s.is_parked(i), i in finished]
            assert sum(places) == 1, (i, places)
        if not s.busy:
            break
    assert s.parks >= 0 and s.max_in_flight <= n


def test_finishing_a_parked_sample_whose_result_arrived_forgets_it():
    s = SlotScheduler(num_samples=3, slots=1)
    s.admit()
    s.pause(0)
    s.decoded()
    s.park(0, "row0")
    s.admit()
    s.resolve(0)
    s.finish(0)
    s.finish(1)
    assert s.unpark() == [] and s.admit() == [(2, 0)]
