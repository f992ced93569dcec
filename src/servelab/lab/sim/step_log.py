"""An instance's StepStats kept as columns: a day of traffic sends millions of them to the sink.

A StepLog is a sequence of StepStats (each rebuilt on access, equal to the one appended) whose fields
are packed arrays, one per field; the meters read the columns. Entries arrive as tuples and are packed
a few thousand at a time (a packed array grows slowly one value at a time). A step's breakdown and a
decode run's segments and a run's states (core/decode_runs/run_states.py) are kept only for the entries that have them
(steps have a breakdown, priced runs segments, runs of several steps states). Every step's end goes to one timeline, in order, at once: a request that made one token a
step has its token times there (finished.py).
"""
from __future__ import annotations

from array import array
from bisect import bisect_left
from itertools import accumulate, chain
from operator import attrgetter
from typing import Any, Iterator

from servelab.core.engine_core import StepStats
from servelab.core.decode_runs.run_states import FIELDS as RUN_STATE_FIELDS, RunStates

BREAKDOWN_KEYS = ("weights", "attention", "communication", "overhead")  # the cost model's, in its order
_FIELDS = ("start", "duration", "kv_usage", "num_scheduled_tokens", "num_prefill_tokens", "num_decode_requests",
           "num_running", "num_waiting", "num_preempted", "num_reserved_unused_slots", "num_steps")
_NUM_FLOATS = 3
_row_of = attrgetter(*_FIELDS)
_run_states_row = attrgetter(*RUN_STATE_FIELDS)
# A RunStates field's value for an entry without one: the column it sums up.
_STATE_OF_A_STEP = {"mean_running": "num_running", "mean_kv_usage": "kv_usage",
                    "mean_reserved_unused_slots": "num_reserved_unused_slots", "peak_running": "num_running",
                    "peak_running_s": "duration", "peak_kv_usage": "kv_usage"}
_PACK_EVERY = 256  # small: a stopped replica keeps what it has not packed


class StepLog:
    def __init__(self) -> None:
        # 32-bit counts: an entry's stay far below 2**31 (one that did not fit would raise OverflowError)
        self._columns = {name: array("d" if k < _NUM_FLOATS else "i") for k, name in enumerate(_FIELDS)}
        self._timeline_starts = array("q")  # where each entry's step ends begin in the timeline
        self._rows: list[tuple] = []  # entries not packed yet
        self._num = 0
        # entries with a breakdown of the cost model's keys: their index, then their values row by row
        self._breakdown_index = array("i")
        self._breakdown_values = array("d")
        self._other_breakdowns: dict[int, dict[str, float]] = {}  # any other non-empty breakdown
        # entries with decode segments: their index and where their segments start in _segment_rows
        self._segments_index = array("i")
        self._segments_start = array("i")
        self._segment_rows = array("i")  # (number of steps, batch size) pairs, flat
        # entries with run states: their index, then their values row by row
        self._states_index = array("i")
        self._states_values = array("d")
        self._pending_extras: list[tuple[int, dict[str, float], list[tuple[int, int]], RunStates | None]] = []
        self.timeline = array("d")  # every entry's step_ends, entry after entry

    def append(self, s: StepStats) -> None:
        if len(s.step_ends) != s.num_steps:
            raise ValueError(f"a StepStats of {s.num_steps} steps with {len(s.step_ends)} step ends")
        self._rows.append(_row_of(s))
        self.timeline.fromlist(s.step_ends)
        if s.breakdown or s.decode_segments or s.run_states is not None:
            self._pending_extras.append((self._num, s.breakdown, s.decode_segments, s.run_states))
        self._num += 1
        if len(self._rows) >= _PACK_EVERY:
            self._pack()

    def _pack(self) -> None:
        rows, self._rows = self._rows, []
        if rows:
            flat = list(chain.from_iterable(rows))
            width = len(_FIELDS)
            for k, column in enumerate(self._columns.values()):
                column.fromlist(flat[k::width])
            num_steps = flat[width - 1::width]
            first = self._timeline_starts[-1] + self._columns["num_steps"][-len(rows) - 1] \
                if len(self._timeline_starts) else 0
            self._timeline_starts.fromlist(list(accumulate(num_steps[:-1], initial=first)))
        extras, self._pending_extras = self._pending_extras, []
        if not extras:
            return
        # gathered in lists and packed once: most entries have a breakdown or segments
        breakdown_index: list[int] = []
        breakdown_values: list[float] = []
        states_index: list[int] = []
        states_values: list[float] = []
        segments_index: list[int] = []
        segments_start: list[int] = []
        segment_rows: list[int] = []
        num_segment_values = len(self._segment_rows)
        for index, breakdown, segments, states in extras:
            if breakdown:
                if tuple(breakdown) == BREAKDOWN_KEYS:
                    breakdown_index.append(index)
                    breakdown_values += breakdown.values()
                else:
                    self._other_breakdowns[index] = dict(breakdown)
            if segments:
                segments_index.append(index)
                segments_start.append(num_segment_values + len(segment_rows))
                segment_rows += chain.from_iterable(segments)
            if states is not None:
                states_index.append(index)
                states_values += _run_states_row(states)
        self._breakdown_index.fromlist(breakdown_index)
        self._breakdown_values.fromlist(breakdown_values)
        self._segments_index.fromlist(segments_index)
        self._segments_start.fromlist(segments_start)
        self._segment_rows.fromlist(segment_rows)
        self._states_index.fromlist(states_index)
        self._states_values.fromlist(states_values)

    def column(self, name: str) -> list:
        """One field over all entries, in order, as Python numbers; or one field of RunStates, an entry
        without them giving the state it has (or for peak_running_s its duration)."""
        self._pack()
        if name not in _STATE_OF_A_STEP:
            return self._columns[name].tolist()
        values: list[Any] = self._columns[_STATE_OF_A_STEP[name]].tolist()
        width, k = len(RUN_STATE_FIELDS), RUN_STATE_FIELDS.index(name)
        states = self._states_values[k::width].tolist()
        if name == "peak_running":
            states = list(map(int, states))
        for index, value in zip(self._states_index, states):
            values[index] = value
        return values

    def __len__(self) -> int:
        return self._num

    def __getitem__(self, index: int) -> StepStats:
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        index %= len(self)
        self._pack()
        fields = {name: column[index] for name, column in self._columns.items()}
        start = self._timeline_starts[index]
        ends = self.timeline[start:start + fields["num_steps"]].tolist()
        return StepStats(**fields, breakdown=self.breakdown(index), decode_segments=self.decode_segments(index),
                         step_ends=ends, run_states=self.run_states(index))

    def __iter__(self) -> Iterator[StepStats]:
        return (self[index] for index in range(len(self)))

    def breakdown(self, index: int) -> dict[str, float]:
        self._pack()
        row = _row(self._breakdown_index, index)
        if row is None:
            return dict(self._other_breakdowns.get(index, {}))
        return dict(zip(BREAKDOWN_KEYS, self._breakdown_values[4 * row:4 * row + 4]))

    def decode_segments(self, index: int) -> list[tuple[int, int]]:
        self._pack()
        row = _row(self._segments_index, index)
        if row is None:
            return []
        start = self._segments_start[row]
        stop = self._segments_start[row + 1] if row + 1 < len(self._segments_start) else len(self._segment_rows)
        flat = self._segment_rows[start:stop]
        return list(zip(flat[::2], flat[1::2]))

    def run_states(self, index: int) -> RunStates | None:
        self._pack()
        row = _row(self._states_index, index)
        if row is None:
            return None
        width = len(RUN_STATE_FIELDS)
        values: list[Any] = self._states_values[width * row:width * row + width].tolist()
        values[RUN_STATE_FIELDS.index("peak_running")] = int(values[RUN_STATE_FIELDS.index("peak_running")])
        return RunStates(*values)

    def run_indices(self) -> list[int]:
        """The entries with decode segments (priced runs), in order."""
        self._pack()
        return self._segments_index.tolist()

    def segments_in_order(self) -> Iterator[tuple[int, int]]:
        """Every entry's decode segments, (number of steps, batch size), entry after entry."""
        self._pack()
        flat = self._segment_rows
        return zip(flat[::2], flat[1::2])

    def breakdowns_in_order(self) -> Iterator[tuple[int, dict[str, float]]]:
        """(index, breakdown) of every entry with a non-empty breakdown, by index."""
        self._pack()
        others = sorted(self._other_breakdowns)
        values, j = self._breakdown_values, 0
        for row, index in enumerate(self._breakdown_index):
            while j < len(others) and others[j] < index:
                yield others[j], self._other_breakdowns[others[j]]
                j += 1
            yield index, dict(zip(BREAKDOWN_KEYS, values[4 * row:4 * row + 4]))
        for index in others[j:]:
            yield index, self._other_breakdowns[index]


def _row(indices: array, index: int) -> int | None:
    row = bisect_left(indices, index)
    return row if row < len(indices) and indices[row] == index else None
