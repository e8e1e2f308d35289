"""Which trajectory decodes in which slot: the rollout's host-only scheduler.

The engine has `slots` rows. Samples (ids 0..n-1) wait in a queue for a free slot (`admit`). A
sample whose model segment ended waits for its tool or environment (`pause`): it keeps its slot
but does not decode (`active`). When samples want a slot and none is free, samples that have
waited since before the last chunk give theirs up (`to_park`, then `park`): the caller lifts
their cache row out of the engine and the scheduler holds it. Once a parked sample's result has
arrived (`resolve`) it comes back into whichever slot frees first (`unpark`), ahead of queued
samples. `finish` frees a slot, or drops a parked row.

It never touches the engine: it deals in sample ids, slots, and the rows it holds for the caller
(opaque objects); `tests/test_rollout_scheduler.py` drives it alone. The free slot taken is
always the lowest, so a run's slot assignment (and, with several processes, which process runs
a sample's tools) depends only on the order of events.

    sched = SlotScheduler(num_samples=6, slots=2)
    sched.admit()            # [(0, 0), (1, 1)]: sample 0 in slot 0, sample 1 in slot 1
    sched.decoded(); sched.pause(0); sched.decoded()
    sched.to_park()          # [(0, 0)]: sample 0 has waited a whole chunk; samples are queued
    sched.park(0, row)       # slot 0 is free; `row` is held until sample 0 comes back
"""

from __future__ import annotations

import bisect
import collections
from typing import Any

import numpy as np


class SlotScheduler:
    """Slots, queue, paused and parked samples of one rollout.

    Args:
      num_samples: samples to run, queued in id order.
      slots: the engine's slots.
      max_parked: most samples parked at once (None: as many as the slots; 0: a paused sample
        keeps its slot until its result arrives).

    Attributes:
      chunks: decode chunks so far (`decoded`).
      parks: times a sample gave up its slot (`park`).
      max_in_flight: most samples admitted and not finished at once (in slots or parked).
    """

    def __init__(self, num_samples: int, slots: int, max_parked: int | None = None):
        self.slots = int(slots)
        self.max_parked = self.slots if max_parked is None else int(max_parked)
        self.queue: collections.deque[int] = collections.deque(range(num_samples))
        self._free = list(range(self.slots))  # kept sorted: the lowest free slot is taken
        self.running: dict[int, int] = {}  # slot -> sample id
        self._slot_of: dict[int, int] = {}  # sample id -> slot
        self._paused: dict[int, int] = {}  # sample id -> `chunks` when it paused
        self._parked: dict[int, Any] = {}  # sample id -> its row while out of a slot
        self._returning: collections.deque[int] = collections.deque()  # parked, result in
        self.chunks = 0
        self.parks = 0
        self.max_in_flight = 0

    # ------------------------------------------------------------------ queries
    @property
    def busy(self) -> bool:
        """Samples are queued, in slots, or parked."""
        return bool(self.queue or self.running or self._parked)

    def slot(self, sample: int) -> int:
        """The sample's slot, or -1 (queued, parked or finished)."""
        return self._slot_of.get(sample, -1)

    def is_paused(self, sample: int) -> bool:
        return sample in self._paused

    def is_parked(self, sample: int) -> bool:
        return sample in self._parked

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def active(self) -> np.ndarray:
        """bool [slots]: the slots whose sample decodes in the next chunk (in a slot, not
        paused)."""
        mask = np.zeros((self.slots,), bool)
        for slot, sample in self.running.items():
            mask[slot] = sample not in self._paused
        return mask

    # ------------------------------------------------------------------ events
    def decoded(self) -> None:
        """One decode chunk ran."""
        self.chunks += 1

    def pause(self, sample: int) -> None:
        """The sample's segment ended; it waits for its tool or environment."""
        self._paused[sample] = self.chunks

    def resolve(self, sample: int) -> bool:
        """The paused sample's result arrived (it goes on). Returns whether it is in a slot
        (its observation can be appended now); a parked one waits to come back (`unpark`)."""
        del self._paused[sample]
        if sample in self._slot_of:
            return True
        self._returning.append(sample)
        return False

    def finish(self, sample: int) -> None:
        """The sample ended: its slot is free, its parked row (if any) dropped."""
        self._paused.pop(sample, None)
        slot = self._slot_of.pop(sample, None)
        if slot is not None:
            del self.running[slot]
            bisect.insort(self._free, slot)
        if sample in self._parked:
            del self._parked[sample]
            if sample in self._returning:
                self._returning.remove(sample)

    def to_park(self) -> list[tuple[int, int]]:
        """(sample, slot) of the paused samples to park now: as many as samples want a slot
        beyond the free ones (parked ones back from their tools, then queued ones), within
        `max_parked`. Only samples paused before the last chunk (or any, while no slot
        decodes), the latest paused first: an instant result, such as an environment step's,
        arrives within the chunk it was dispatched in, and moving that row out and back would
        gain nothing."""
        want = len(self._returning) + len(self.queue) - len(self._free)
        room = self.max_parked - len(self._parked)
        if want <= 0 or room <= 0:
            return []
        decoding = any(i not in self._paused for i in self.running.values())
        waited = [
            (i, slot)
            for slot, i in self.running.items()
            if i in self._paused and (self._paused[i] < self.chunks or not decoding)
        ]
        waited.sort(key=lambda e: (-self._paused[e[0]], e[1]))
        return waited[: min(want, room)]

    def park(self, sample: int, row: Any) -> None:
        """The sample leaves its slot (still paused); `row` is kept until it comes back."""
        slot = self._slot_of.pop(sample)
        del self.running[slot]
        bisect.insort(self._free, slot)
        self._parked[sample] = row
        self.parks += 1

    def unpark(self) -> list[tuple[int, int, Any]]:
        """(sample, slot, row) of parked samples whose result arrived, each put back into the
        lowest free slot, in the order their results arrived."""
        back = []
        while self._free and self._returning:
            sample = self._returning.popleft()
            slot = self._take_slot(sample)
            back.append((sample, slot, self._parked.pop(sample)))
        return back

    def admit(self) -> list[tuple[int, int]]:
        """(sample, slot) of queued samples put into free slots, lowest first, in queue order
        (after `unpark`: samples back from their tools come first)."""
        new = []
        while self._free and self.queue:
            sample = self.queue.popleft()
            new.append((sample, self._take_slot(sample)))
        self.max_in_flight = max(self.max_in_flight, len(self.running) + len(self._parked))
        return new

    def _take_slot(self, sample: int) -> int:
        slot = self._free.pop(0)
        self.running[slot] = sample
        self._slot_of[sample] = slot
        return slot
