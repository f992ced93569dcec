"""An instance's StepStats kept as columns: a day of traffic sends millions of them to the sink.

A StepLog is a sequence of StepStats (each rebuilt on access, equal to the one appended) whose fields
are packed arrays; the meters read the columns. A step's breakdown and a decode run's segments are
kept only for the entries that have them (steps have a breakdown, priced runs segments). Every step's
end goes to one timeline, in order: a request that made one token a step has its token times there.
"""
from __future__ import annotations

from array import array
from bisect import bisect_left
from operator import attrgetter
from typing import Iterator

from servelab.core.engine import StepStats

BREAKDOWN_KEYS = ("weights", "attention", "communication", "overhead")  # the cost model's, in its order
_FLOAT_FIELDS = ("start", "duration", "kv_usage")
_INT_FIELDS = ("num_scheduled_tokens", "num_prefill_tokens", "num_decode_requests", "num_running", "num_waiting",
               "num_preempted", "num_reserved_unused_slots", "num_steps", "timeline_start")
_floats_of = attrgetter(*_FLOAT_FIELDS)
_counts_of = attrgetter(*_INT_FIELDS[:-1])  # the StepStats' own; timeline_start is the log's


class StepLog:
    def __init__(self) -> None:
        # one row per entry: _FLOAT_FIELDS in `floats`, _INT_FIELDS in `ints` (32-bit: an entry's counts and
        # an instance's steps stay far below 2**31, and a value that did not fit would raise OverflowError)
        self.floats = array("d")
        self.ints = array("i")
        # entries with a breakdown of the cost model's keys: their index, then their values row by row
        self.breakdown_index = array("i")
        self.breakdown_values = array("d")
        self.other_breakdowns: dict[int, dict[str, float]] = {}  # any other non-empty breakdown
        # entries with decode segments: their index and where their segments start in segment_rows
        self.segments_index = array("i")
        self.segments_start = array("i")
        self.segment_rows = array("i")  # (number of steps, batch size) pairs, flat
        self.timeline = array("d")  # every entry's step_ends, entry after entry

    def append(self, s: StepStats) -> None:
        index = len(self.floats) // len(_FLOAT_FIELDS)
        self.floats.extend(_floats_of(s))
        self.ints.extend(_counts_of(s))
        self.ints.append(len(self.timeline))  # timeline_start
        self.timeline.extend(s.step_ends)
        breakdown = s.breakdown
        if breakdown:
            if tuple(breakdown) == BREAKDOWN_KEYS:
                self.breakdown_index.append(index)
                self.breakdown_values.extend(breakdown.values())
            else:
                self.other_breakdowns[index] = dict(breakdown)
        segments = s.decode_segments
        if segments:
            self.segments_index.append(index)
            self.segments_start.append(len(self.segment_rows))
            for segment in segments:
                self.segment_rows.extend(segment)

    def column(self, name: str) -> list:
        """One field over all entries, in order, as Python numbers."""
        if name in _FLOAT_FIELDS:
            return self.floats[_FLOAT_FIELDS.index(name)::len(_FLOAT_FIELDS)].tolist()
        return self.ints[_INT_FIELDS.index(name)::len(_INT_FIELDS)].tolist()

    def __len__(self) -> int:
        return len(self.floats) // len(_FLOAT_FIELDS)

    def __getitem__(self, index: int) -> StepStats:
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        index %= len(self)
        width = len(_INT_FIELDS)
        start, duration, kv_usage = self.floats[3 * index:3 * index + 3]
        (num_scheduled_tokens, num_prefill_tokens, num_decode_requests, num_running, num_waiting, num_preempted,
         num_reserved_unused_slots, num_steps, ends_start) = self.ints[width * index:width * index + width]
        ends_stop = self.ints[width * index + 2 * width - 1] if index + 1 < len(self) else len(self.timeline)
        return StepStats(start, duration, num_scheduled_tokens, num_prefill_tokens, num_decode_requests, num_running,
                         num_waiting, num_preempted, kv_usage, num_reserved_unused_slots, self.breakdown(index),
                         num_steps, self.decode_segments(index), self.timeline[ends_start:ends_stop].tolist())

    def __iter__(self) -> Iterator[StepStats]:
        return (self[index] for index in range(len(self)))

    def breakdown(self, index: int) -> dict[str, float]:
        row = _row(self.breakdown_index, index)
        if row is None:
            return dict(self.other_breakdowns.get(index, {}))
        return dict(zip(BREAKDOWN_KEYS, self.breakdown_values[4 * row:4 * row + 4]))

    def decode_segments(self, index: int) -> list[tuple[int, int]]:
        row = _row(self.segments_index, index)
        if row is None:
            return []
        start = self.segments_start[row]
        stop = self.segments_start[row + 1] if row + 1 < len(self.segments_start) else len(self.segment_rows)
        flat = self.segment_rows[start:stop]
        return list(zip(flat[::2], flat[1::2]))

    def segments_in_order(self) -> Iterator[tuple[int, int]]:
        """Every entry's decode segments, (number of steps, batch size), entry after entry."""
        flat = self.segment_rows
        return zip(flat[::2], flat[1::2])

    def breakdowns_in_order(self) -> Iterator[tuple[int, dict[str, float]]]:
        """(index, breakdown) of every entry with a non-empty breakdown, by index."""
        others = sorted(self.other_breakdowns)
        values, j = self.breakdown_values, 0
        for row, index in enumerate(self.breakdown_index):
            while j < len(others) and others[j] < index:
                yield others[j], self.other_breakdowns[others[j]]
                j += 1
            yield index, dict(zip(BREAKDOWN_KEYS, values[4 * row:4 * row + 4]))
        for index in others[j:]:
            yield index, self.other_breakdowns[index]


def _row(indices: array, index: int) -> int | None:
    row = bisect_left(indices, index)
    return row if row < len(indices) and indices[row] == index else None
