"""StepOutputMailbox: what waits for a lagging event loop stays bounded (at most two snapshots a request),
and what the loop gets is what it would have made of every item: the same latest snapshots, first-token
times, finished snapshots, errors and per-step samples, in order."""
import asyncio
import threading

import pytest

from servelab.engine.core_client import EngineDeadError
from servelab.engine.core_protocol import EngineStepOutputs, RequestError
from servelab.engine.output_mailbox import StepOutputMailbox
from servelab.metrics.events import EngineState, StepSample
from servelab.outputs import CompletionOutput, RequestOutput

STATE = EngineState(0, 0, 0.0, 8, 8, 4, 0, 4, 0)


def snapshot(request_id: str, num_tokens: int, finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(0, " w" * num_tokens, list(range(num_tokens)),
                                  finish_reason="length" if finished else None)
    return RequestOutput(request_id, "hi", [1, 2], [completion], finished)


def step_item(step: int, *outputs: RequestOutput, accepted=(), errors=()) -> EngineStepOutputs:
    return EngineStepOutputs(0, STATE, float(step), accepted=list(accepted), errors=list(errors),
                             outputs=list(outputs), step=StepSample(0.001, len(outputs), len(outputs), 0))


def waiting_snapshots(items: list[EngineStepOutputs]) -> dict[str, list[int]]:
    """request id -> number of tokens of each of its snapshots still in items."""
    out: dict[str, list[int]] = {}
    for item in items:
        for o in item.outputs:
            out.setdefault(o.request_id, []).append(len(o.outputs[0].token_ids))
    return out


async def drain(mailbox: StepOutputMailbox) -> list[EngineStepOutputs]:
    items = []
    while len(mailbox):
        items.append(await mailbox.get())
    return items


def test_a_lagging_loop_holds_two_snapshots_a_request_and_gets_every_step():
    async def main():
        mailbox = StepOutputMailbox(asyncio.get_running_loop())
        # 200 steps while the loop does not read: "a" prefills (no token) then decodes, "b" joins at step 50
        # and finishes at step 120, "c" fails at step 150
        for step in range(200):
            outputs = [snapshot("a", step)]
            if 50 <= step <= 120:
                outputs.append(snapshot("b", step - 50, finished=step == 120))
            if 100 <= step < 150:
                outputs.append(snapshot("c", step - 99))
            errors = [RequestError("c", "step failed")] if step == 150 else []
            mailbox.put(step_item(step, *outputs, accepted=["b"] if step == 50 else [], errors=errors))
        assert len(mailbox) == 200
        return await drain(mailbox), mailbox.num_tracked_requests

    items, num_tracked = asyncio.run(main())
    assert [item.output_time for item in items] == [float(s) for s in range(200)]  # one per step, in order
    assert all(item.step is not None for item in items)
    snapshots = waiting_snapshots(items)
    # a: the step-0 snapshot (no token, dropped), its first with a token (step 1) and its latest
    assert snapshots["a"] == [1, 199]
    assert items[1].outputs[0].request_id == "a"  # its first token keeps its step's time
    # b: its first token (step 51) and its finished snapshot, which is never dropped
    assert snapshots["b"] == [1, 70]
    assert items[120].outputs[-1].finished
    assert [i for i, item in enumerate(items) if item.accepted] == [50]
    # c: its first token and the last snapshot before its error, delivered before the error
    assert snapshots["c"] == [1, 50]
    assert [e.request_id for e in items[150].errors] == ["c"]
    assert num_tracked == 0


def test_a_loop_that_keeps_up_gets_every_snapshot():
    async def main():
        mailbox = StepOutputMailbox(asyncio.get_running_loop())
        got = []
        for step in range(20):
            mailbox.put(step_item(step, snapshot("a", step, finished=step == 19)))
            got.append(await mailbox.get())
        return got, mailbox.num_tracked_requests

    got, num_tracked = asyncio.run(main())
    assert [len(item.outputs[0].outputs[0].token_ids) for item in got] == list(range(20))
    assert num_tracked == 0


def test_snapshots_already_delivered_are_never_touched():
    async def main():
        mailbox = StepOutputMailbox(asyncio.get_running_loop())
        mailbox.put(step_item(0, snapshot("a", 1)))
        mailbox.put(step_item(1, snapshot("a", 2)))
        first = await mailbox.get()  # the first-token snapshot; "a"'s step-1 snapshot still waits
        second_waiting = mailbox._items[0]
        mailbox.put(step_item(2, snapshot("a", 3)))  # drops the waiting step-1 snapshot, not the delivered one
        rest = await drain(mailbox)
        return first, second_waiting, rest

    first, second, rest = asyncio.run(main())
    assert [len(o.outputs[0].token_ids) for o in first.outputs] == [1]
    assert second.outputs == [] and rest[0] is second
    assert [len(o.outputs[0].token_ids) for o in rest[1].outputs] == [3]


def test_puts_from_another_thread_wake_the_loop_and_an_error_is_raised_in_order():
    async def main():
        mailbox = StepOutputMailbox(asyncio.get_running_loop())

        def engine_thread():
            for step in range(100):
                mailbox.put(step_item(step, snapshot("a", step + 1)))
            mailbox.put(EngineDeadError("gone"))

        thread = threading.Thread(target=engine_thread)
        thread.start()
        items = []
        with pytest.raises(EngineDeadError, match="gone"):
            while True:
                items.append(await asyncio.wait_for(mailbox.get(), 30))
        thread.join()
        return items

    items = asyncio.run(main())
    assert [item.output_time for item in items] == [float(s) for s in range(100)]
    assert len(items[-1].outputs[0].outputs[0].token_ids) == 100  # the latest snapshot always arrives


def test_a_wake_up_for_an_item_already_taken_does_not_spin_the_loop():
    result = {}

    def run():
        async def main():
            mailbox = StepOutputMailbox(asyncio.get_running_loop())
            mailbox.put(step_item(0, snapshot("a", 1)))  # schedules a wake-up
            await mailbox.get()  # takes the item before the wake-up ran
            await asyncio.sleep(0)  # the wake-up runs now, with nothing waiting
            try:
                await asyncio.wait_for(mailbox.get(), 0.2)
            except asyncio.TimeoutError:
                result["waited"] = True

        asyncio.run(main())

    # a get() that spins never yields to the loop, so wait_for cannot end it: watched from this thread
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(20)
    assert result == {"waited": True}
