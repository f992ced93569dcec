"""An instance's StepStats kept as columns: a day of traffic sends millions of them to the sink.

A StepLog is a sequence of StepStats (each rebuilt on access, equal to the one appended) whose fields
are packed arrays; the meters read the columns. A step's breakdown and a decode run's segments are
kept only for the entries that have them (steps have a breakdown, priced runs segments).
"""
from __future__ import annotations

from array import array
from bisect import bisect_left
from typing import Iterator

from servelab.core.engine import StepStats

BREAKDOWN_KEYS = ("weights", "attention", "communication", "overhead")  # the cost model's, in its order
_INT_FIELDS = ("num_scheduled_tokens", "num_prefill_tokens", "num_decode_requests", "num_running", "num_waiting",
               "num_preempted", "num_reserved_unused_slots", "num_steps")


class StepLog:
    def __init__(self) -> None:
        self.starts = array("d")
        self.durations = array("d")
        self.kv_usage = array("d")
        self.ints = {name: array("q") for name in _INT_FIELDS}
        # entries with a breakdown of the cost model's keys: their index, then one column per key
        self.breakdown_index = array("q")
        self.breakdown_values = tuple(array("d") for _ in BREAKDOWN_KEYS)
        self.other_breakdowns: dict[int, dict[str, float]] = {}  # any other non-empty breakdown
        # entries with decode segments: their index and where their segments start in the two columns
        self.segments_index = array("q")
        self.segments_start = array("q")
        self.segment_counts = array("q")
        self.segment_batch_sizes = array("q")

    def append(self, s: StepStats) -> None:
        index = len(self.starts)
        self.starts.append(s.start)
        self.durations.append(s.duration)
        self.kv_usage.append(s.kv_usage)
        ints = self.ints
        ints["num_scheduled_tokens"].append(s.num_scheduled_tokens)
        ints["num_prefill_tokens"].append(s.num_prefill_tokens)
        ints["num_decode_requests"].append(s.num_decode_requests)
        ints["num_running"].append(s.num_running)
        ints["num_waiting"].append(s.num_waiting)
        ints["num_preempted"].append(s.num_preempted)
        ints["num_reserved_unused_slots"].append(s.num_reserved_unused_slots)
        ints["num_steps"].append(s.num_steps)
        breakdown = s.breakdown
        if breakdown:
            if tuple(breakdown) == BREAKDOWN_KEYS:
                self.breakdown_index.append(index)
                for column, value in zip(self.breakdown_values, breakdown.values()):
                    column.append(value)
            else:
                self.other_breakdowns[index] = dict(breakdown)
        if s.decode_segments:
            self.segments_index.append(index)
            self.segments_start.append(len(self.segment_counts))
            for count, batch_size in s.decode_segments:
                self.segment_counts.append(count)
                self.segment_batch_sizes.append(batch_size)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> StepStats:
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        index %= len(self)
        ints = self.ints
        return StepStats(self.starts[index], self.durations[index], ints["num_scheduled_tokens"][index],
                         ints["num_prefill_tokens"][index], ints["num_decode_requests"][index],
                         ints["num_running"][index], ints["num_waiting"][index], ints["num_preempted"][index],
                         self.kv_usage[index], ints["num_reserved_unused_slots"][index], self.breakdown(index),
                         ints["num_steps"][index], self.decode_segments(index))

    def __iter__(self) -> Iterator[StepStats]:
        return (self[index] for index in range(len(self)))

    def breakdown(self, index: int) -> dict[str, float]:
        row = _row(self.breakdown_index, index)
        if row is None:
            return dict(self.other_breakdowns.get(index, {}))
        return {key: column[row] for key, column in zip(BREAKDOWN_KEYS, self.breakdown_values)}

    def decode_segments(self, index: int) -> list[tuple[int, int]]:
        row = _row(self.segments_index, index)
        if row is None:
            return []
        start = self.segments_start[row]
        stop = self.segments_start[row + 1] if row + 1 < len(self.segments_start) else len(self.segment_counts)
        return list(zip(self.segment_counts[start:stop], self.segment_batch_sizes[start:stop]))

    def breakdowns_in_order(self) -> Iterator[tuple[int, dict[str, float]]]:
        """(index, breakdown) of every entry with a non-empty breakdown, by index."""
        rows = range(len(self.breakdown_index))
        others = sorted(self.other_breakdowns)
        j = 0
        for row in rows:
            index = self.breakdown_index[row]
            while j < len(others) and others[j] < index:
                yield others[j], self.other_breakdowns[others[j]]
                j += 1
            yield index, {key: column[row] for key, column in zip(BREAKDOWN_KEYS, self.breakdown_values)}
        for index in others[j:]:
            yield index, self.other_breakdowns[index]


def _row(indices: array, index: int) -> int | None:
    row = bisect_left(indices, index)
    return row if row < len(indices) and indices[row] == index else None
