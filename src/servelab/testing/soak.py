"""A soak of the real gateway at saturation: a seeded mix of completions and chat, streaming and not, n > 1,
stop strings, logprobs, clients that leave (before the first token, mid-stream, during a long prefill),
requests that run past --request-timeout and prompts that trigger an injected step fault; then the books
are checked. Shared by tests/gateway/test_soak.py (about 1,000 requests) and benchmarks/soak/run.py (10,000).

Each request carries X-Request-Id soak-<i>, so the server's request log can be matched to the client's view:
every request the client did not abandon has exactly one terminal outcome on both sides."""
from __future__ import annotations

import asyncio
import collections
import json
import random
import time
from dataclasses import dataclass, field

import httpx

FAULT_WORD = "hello"  # the stub server fails every step that computes it (--stub-fail-word); it never samples it
LEAVE_KINDS = ("before_first_token", "mid_stream", "during_prefill")


@dataclass(frozen=True)
class SoakPlan:
    """What request i does, drawn from a seeded RNG."""
    index: int
    chat: bool
    stream: bool
    n: int
    stop: list[str] | None
    logprobs: bool
    max_tokens: int
    long_prompt: bool
    fault: bool
    leave: str | None  # one of LEAVE_KINDS
    leave_after: int  # chunks (mid_stream) or milliseconds (before_first_token, during_prefill)
    runs_past_timeout: bool


def make_plan(index: int, rng: random.Random) -> SoakPlan:
    leave = rng.choice(LEAVE_KINDS) if rng.random() < 0.15 else None
    runs_past_timeout = leave is None and rng.random() < 0.02
    stream = leave in ("before_first_token", "mid_stream") or (leave is None and rng.random() < 0.5)
    return SoakPlan(
        index=index, chat=rng.random() < 0.4, stream=stream, n=rng.choice((1, 1, 1, 2, 3)),
        stop=rng.choice((None, None, ["w7"], ["w9", "\u0000", "日本"])), logprobs=rng.random() < 0.2,
        max_tokens=1900 if runs_past_timeout else rng.randint(1, 24), long_prompt=leave == "during_prefill",
        fault=leave is None and not runs_past_timeout and rng.random() < 0.001, leave=leave,
        leave_after=rng.randint(1, 4) if leave == "mid_stream" else rng.randint(0, 20),
        runs_past_timeout=runs_past_timeout)


def request_body(plan: SoakPlan) -> dict:
    words = " ".join(f"w{(plan.index + k) % 32}" for k in range(600 if plan.long_prompt else 1 + plan.index % 8))
    prompt = f"hi {words}" + (f" {FAULT_WORD}" if plan.fault else "")
    body: dict = {"max_tokens": plan.max_tokens, "n": plan.n, "stream": plan.stream,
                  "ignore_eos": plan.runs_past_timeout}
    if plan.stop:
        body["stop"] = plan.stop
    if plan.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        if plan.logprobs:
            body.update(logprobs=True, top_logprobs=2)
    else:
        body["prompt"] = prompt
        if plan.logprobs:
            body["logprobs"] = 2
    if plan.stream and plan.index % 3 == 0:
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass
class SoakReport:
    num_requests: int = 0
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    planned: collections.Counter = field(default_factory=collections.Counter)
    lost: list[str] = field(default_factory=list)
    by_index: dict[int, str] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def num_5xx(self) -> dict[str, int]:
        return {k: v for k, v in self.outcomes.items() if k.startswith("5")}


def _check_stream(body: str, plan: SoakPlan) -> str:
    """The outcome of a complete SSE body, or raise ValueError when it is not exactly one terminal outcome."""
    if not body.endswith("data: [DONE]\n\n") or body.count("data: [DONE]") != 1:
        raise ValueError(f"no single [DONE] at the end: {body[-200:]!r}")
    finished: collections.Counter = collections.Counter()
    error = None
    for frame in body[:-2].split("\n\n")[:-1]:
        if not frame.startswith("data: "):
            raise ValueError(f"bad frame {frame[:100]!r}")
        data = json.loads(frame[6:])
        if "error" in data:
            if error is not None:
                raise ValueError("two error events")
            error = data["error"]
            continue
        if error is not None:
            raise ValueError("a chunk after the error event")
        for choice in data["choices"]:
            if choice.get("finish_reason") is not None:
                finished[choice["index"]] += 1
    if error is not None:
        return f"{_status_of(error)}:{error['code']}"
    if sorted(finished) != list(range(plan.n)) or any(v != 1 for v in finished.values()):
        raise ValueError(f"choices finished {dict(finished)} times, expected each of {plan.n} once")
    return "200"


def _status_of(error: dict) -> int:
    return {"request_timeout": 504, "engine_dead": 503, "shutting_down": 503, "slow_reader": 503}.get(
        error["code"], 500)


def _check_json(response: httpx.Response, plan: SoakPlan) -> str:
    data = response.json()
    if response.status_code != 200:
        error = data["error"]
        if set(error) != {"message", "type", "param", "code"}:
            raise ValueError(f"not an OpenAI error body: {data}")
        return f"{response.status_code}:{error['code']}"
    reasons = [c["finish_reason"] for c in data["choices"]]
    if len(reasons) != plan.n or any(r not in ("stop", "length") for r in reasons):
        raise ValueError(f"choices {reasons}")
    return "200"


async def _one(http: httpx.AsyncClient, url: str, plan: SoakPlan, headers: dict) -> str:
    path = "/v1/chat/completions" if plan.chat else "/v1/completions"
    headers = {**headers, "X-Request-Id": f"soak-{plan.index}"}
    body = request_body(plan)
    if plan.leave in ("before_first_token", "during_prefill"):
        async def until_first_bytes() -> None:
            async with httpx.AsyncClient(timeout=120) as own:  # a client of its own, as a real one would be
                async with own.stream("POST", url + path, json=body, headers=headers) as response:
                    async for _ in response.aiter_raw():
                        break  # the first bytes of the body: leave now

        try:  # cancelled after leave_after ms: the connection is dropped wherever the request is
            await asyncio.wait_for(until_first_bytes(), plan.leave_after / 1000)
        except asyncio.TimeoutError:
            pass
        return "left:" + plan.leave
    if plan.stream:
        async with http.stream("POST", url + path, json=body, headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                return _check_json(response, plan)
            text = ""
            async for chunk in response.aiter_text():
                text += chunk
                if plan.leave == "mid_stream" and text.count("\n\ndata: ") + 1 >= plan.leave_after:
                    return "left:mid_stream"
            return _check_stream(text, plan)  # ended before the client meant to leave
    response = await http.post(url + path, json=body, headers=headers)
    return _check_json(response, plan)


async def run_soak(url: str, num_requests: int, concurrency: int, seed: int = 0, headers: dict | None = None,
                   on_progress=None) -> SoakReport:
    """on_progress(num_done) is called every 1% of requests (RSS sampling)."""
    rng = random.Random(seed)
    plans = [make_plan(i, rng) for i in range(num_requests)]
    report = SoakReport(num_requests=num_requests)
    for plan in plans:
        report.planned["leave:" + plan.leave if plan.leave else "past_timeout" if plan.runs_past_timeout
                       else "fault" if plan.fault else "plain"] += 1
    queue = collections.deque(plans)
    done = 0
    step = max(1, num_requests // 100)

    async def worker(http: httpx.AsyncClient) -> None:
        nonlocal done
        while queue:
            plan = queue.popleft()
            try:
                outcome = await _one(http, url, plan, headers or {})
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                outcome = "lost"
                report.lost.append(f"soak-{plan.index} {plan}: {exc!r}")
            report.outcomes[outcome] += 1
            report.by_index[plan.index] = outcome
            done += 1
            if on_progress is not None and done % step == 0:
                on_progress(done)

    start = time.perf_counter()
    # A connection per request, as from many independent clients. With a keep-alive pool, a POST sent on a
    # pooled connection just as the server's keep-alive timer closes it fails with ReadError before the
    # server ever reads it (HTTP/1.1's known race; clients retry such requests): not the server's loss.
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    report.wall_s = time.perf_counter() - start
    return report


def check_request_log(log_lines: list[dict], report: SoakReport) -> dict[str, int]:
    """Server side: no soak request logged twice, and each one whose end the client saw logged exactly once
    with the status the client got."""
    per_id: dict[str, list[dict]] = collections.defaultdict(list)
    for line in log_lines:
        if str(line.get("x_request_id", "")).startswith("soak-"):
            per_id[line["x_request_id"]].append(line)
    seen_to_the_end = {f"soak-{i}": o for i, o in report.by_index.items() if not o.startswith("left:") and o != "lost"}
    return {"num_logged": len(per_id), "num_logged_twice": sum(1 for v in per_id.values() if len(v) > 1),
            "num_seen_to_the_end": len(seen_to_the_end),
            "num_not_logged": sum(1 for i in seen_to_the_end if i not in per_id),
            "num_status_differs": sum(1 for i, o in seen_to_the_end.items()
                                      if i in per_id and str(per_id[i][0]["status"]) != o.split(":")[0])}


def rss_bytes(pid: int, kind: str = "VmRSS") -> int:
    """kind "VmRSS" (all resident pages) or "RssAnon" (its private anonymous part: where a leak grows; the
    file-backed rest, shared libraries mostly, is dropped and read again by the kernel under memory pressure
    from other jobs, which moves VmRSS by tens of MiB on a shared machine without a byte leaked)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(kind + ":"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"no {kind} for pid {pid}")
