"""CostModelExecutor: the lab's executor. It takes the same StepPlan as the model executor and returns a StepResult
whose duration the cost model (executor/cost_model.py) prices instead of running a model. It samples a dummy token
that never stops a request, so outputs run to max_tokens (like ignore_eos). A request verifying speculative drafts
keeps each with probability spec_acceptance_rate, up to the first it rejects (a seeded draw per draft)."""
from __future__ import annotations

import random
from bisect import bisect_left

from servelab.core.plan import DecodeRunPlan, SampledToken, StepPlan, StepResult
from servelab.executor.cost_model import CostModel, _fit, _plan_sums, _received, plan_totals

DUMMY_TOKEN_ID = 0


class CostModelExecutor:
    """The lab's executor: same StepPlan in, StepResult out, duration from the cost model."""

    # Small batches decode long runs, and their runs recur at the same context sums, so their step
    # durations are tabulated (a run's are then a list slice): batch sizes up to this, per table ...
    TABULATED_BATCH_SIZE = 16
    # ... and steps up to this, which bounds the tables to a few MiB.
    TABULATED_STEPS = 8192
    run_token_id = DUMMY_TOKEN_ID  # what every step of a decode run samples

    def __init__(self, cost_model: CostModel, spec_acceptance_rate: float | None = None, seed: int = 0) -> None:
        """spec_acceptance_rate: set when the scheduler drafts (speculative decoding), None when it never does."""
        self.cost_model = cost_model
        self._token = SampledToken(DUMMY_TOKEN_ID)
        self.spec_acceptance_rate = spec_acceptance_rate
        self._random = random.Random(seed)
        # (batch size, residue) -> the decode steps' durations when the contexts sum to residue,
        # residue + batch size, residue + 2 * batch size, ...
        self._decode_tables: dict[tuple[int, int], list[float]] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        scheduled = plan.scheduled
        if scheduled and _received(scheduled[0]) and all(map(_received, scheduled)):
            parts = self.cost_model.received_step_time(len(scheduled))
        else:
            parts = self.cost_model.price(plan_totals(plan))
        if self.spec_acceptance_rate is None:
            return StepResult(sampled=self._sampled(plan), duration=parts.pop("total"), breakdown=parts)
        return StepResult(sampled={s.request_id: self._token for s in plan.scheduled if s.sample and not s.num_spec_tokens},
                          duration=parts.pop("total"), breakdown=parts, spec_sampled=self._spec_sampled(plan))

    def _sampled(self, plan: StepPlan) -> dict[str, SampledToken]:
        return {s.request_id: self._token for s in plan.scheduled if s.sample}

    def _spec_sampled(self, plan: StepPlan) -> dict[str, list[SampledToken]]:
        """Each verifying request's drafts, kept with probability spec_acceptance_rate each up to the first one
        rejected, and the sample after them (placeholder tokens)."""
        spec_sampled = {}
        rate = self.spec_acceptance_rate
        for s in plan.scheduled:
            if s.num_spec_tokens:
                num_accepted = 0
                while num_accepted < s.num_spec_tokens and self._random.random() < rate:  # type: ignore[operator]
                    num_accepted += 1
                spec_sampled[s.request_id] = [self._token] * (1 + num_accepted)
        return spec_sampled

    def price_decode_run(self, run: DecodeRunPlan, within: float = float("inf")) -> tuple[list[float], list[tuple[int, int]]]:
        """Durations of the steps of a multi-step decode run (DecodeRunPlanner.plan), each priced as
        execute() prices that step's StepPlan: one new token per unfinished request, contexts growing
        by one. Only the steps that can start within `within` seconds. Also (number of steps, batch
        size) segments: the batch shrinks as requests finish."""
        cm = self.cost_model
        batch_size, context_sum, num_steps = run.batch_size, run.context_len_sum, run.num_steps
        soonest = run.soonest
        if soonest < num_steps and within < float("inf"):
            # no decode step is shorter than one of a single request with no context
            fits = int(within / sum(cm._decode_fixed(1))) + 1
            if fits < num_steps:
                num_steps = fits
        if soonest >= num_steps:  # nobody leaves before the last step
            return self._decode_step_times(batch_size, context_sum, num_steps, within), [(num_steps, batch_size)]
        # (last step, context in step 1) of those leaving early, by last step: the batch shrinks after each
        departures = run.departures[:bisect_left(run.departures, (num_steps,))]
        durations, segments = [], []
        step, i, elapsed = 1, 0, 0.0
        while step <= num_steps and batch_size:
            segment_end = departures[i][0] if i < len(departures) else num_steps  # the next to leave takes part up to this step
            times = self._decode_step_times(batch_size, context_sum + (step - 1) * batch_size,
                                            segment_end - step + 1, within - elapsed)
            durations += times
            segments.append((len(times), batch_size))
            if len(times) < segment_end - step + 1:
                break  # the rest cannot start within `within`
            elapsed += sum(times)
            step = segment_end + 1
            while i < len(departures) and departures[i][0] < step:
                context_sum -= departures[i][1]
                batch_size -= 1
                i += 1
        return durations, segments

    def _decode_step_times(self, batch_size: int, context_len_sum: int, num_steps: int, within: float) -> list[float]:
        """CostModel.decode_step_times, from the tables where they apply (the same floats)."""
        start, residue = divmod(context_len_sum, batch_size)
        stop = start + num_steps
        if batch_size > self.TABULATED_BATCH_SIZE or stop > self.TABULATED_STEPS:
            return self.cost_model.decode_step_times(batch_size, context_len_sum, num_steps, within)
        table = self._decode_tables.setdefault((batch_size, residue), [])
        if len(table) < stop:
            size = min(max(stop, 2 * len(table)), self.TABULATED_STEPS)
            table += self.cost_model.decode_step_times(batch_size, residue + len(table) * batch_size, size - len(table))
        first = table[start]
        if within < first * num_steps:  # as decode_step_times: steps only grow longer
            num_steps = _fit(num_steps, within, first)
        return table[start:start + num_steps]

    def execute_with_decode_run(self, run: DecodeRunPlan, plan: StepPlan) -> StepResult:
        """One step of a one-step decode run plus the requests its plan admits, priced as execute()
        prices the whole StepPlan single steps would make; sampled tokens for the plan's requests."""
        batch_size, context_sum = run.batch_size, run.context_len_sum
        num_tokens, num_sampled, num_requests, num_pairs, num_kv_tokens, num_arrivals, _ = _plan_sums(plan)  # no drafts in a run
        parts = self.cost_model.step_time(batch_size + num_tokens, batch_size + num_sampled,
                                          batch_size + num_requests, context_sum + num_pairs,
                                          context_sum + batch_size + num_kv_tokens, num_arrivals)
        return StepResult(self._sampled(plan), parts.pop("total"), parts)
