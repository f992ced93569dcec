"""Simulated speculative decoding: the real scheduler drafts placeholders, the cost model's executor accepts each
at the acceptance rate, and a verify step is priced as a step of 1 + K rows."""
import pytest

from servelab.config import SchedulerConfig, SpeculativeConfig
from servelab.core.plan import ScheduledRequest, StepPlan
from servelab.core.request import Request
from servelab.errors import FieldError
from servelab.lab.api import DeploymentRequest
from servelab.lab.catalog import get_device, get_model
from servelab.lab.sim.deployment import Deployment
from servelab.lab.sim.instance import Instance
from servelab.sampling_params import SamplingParams

K = 3


def run_instance(rate, num_requests=40, output_len=101, k=K):
    d = Deployment(get_model("llama-3.1-8b"), get_device("h100"), 1)
    instance = Instance(0, "mixed", SchedulerConfig(max_num_seqs=8), 4000, 16, d.cost_model(),
                        speculative=SpeculativeConfig("ngram", k), spec_acceptance_rate=rate)
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    for i in range(num_requests):
        instance.add_request(Request(str(i), [0] * 200, params, output_len))
    now, num_steps = 0.0, 0
    while instance.has_unfinished_requests():
        now = instance.step(now, float("inf"))
        num_steps += 1
    instance.core.scheduler.block_manager.check_invariants()
    return instance, num_steps


@pytest.mark.parametrize("rate, num_drafts, decode_steps, num_accepted", [(1.0, 25, 25, 75), (0.0, 99, 100, 0)])
def test_every_draft_accepted_or_none(rate, num_drafts, decode_steps, num_accepted):
    # 100 tokens after the first: K + 1 = 4 a step when every draft is accepted, 1 when none is (and no
    # draft for the last token: max_tokens leaves no room)
    instance, _ = run_instance(rate, num_requests=1)
    s = instance.core.scheduler
    assert (s.spec_num_drafts_total, s.spec_num_accepted_tokens_total) == (num_drafts, num_accepted)
    assert len(instance.step_stats) == 1 + decode_steps


def test_mean_tokens_per_step_follow_the_geometric_formula():
    rate = 0.6
    instance, _ = run_instance(rate)
    s = instance.core.scheduler
    expected = (1 - rate ** (K + 1)) / (1 - rate)
    measured = 1 + s.spec_num_accepted_tokens_total / s.spec_num_drafts_total
    assert abs(measured - expected) < 0.1  # 40 requests x ~45 verify steps, seeded
    # position j is reached and accepted with probability rate^(j+1)
    per_pos = [n / s.spec_num_drafts_total for n in s.spec_num_accepted_tokens_per_pos]
    assert all(abs(p - rate ** (j + 1)) < 0.05 for j, p in enumerate(per_pos))


def test_verify_step_priced_as_its_rows():
    cost = Deployment(get_model("llama-3.1-8b"), get_device("h100"), 1).cost_model()
    from servelab.executor.cost_model import plan_totals

    params = SamplingParams(temperature=0.0)
    verify = StepPlan([ScheduledRequest("r", [5, 1, 2, 3], 100, [0] * 7, True, params, num_spec_tokens=3)])
    totals = plan_totals(verify)
    assert (totals.num_tokens, totals.num_sampled, totals.num_spec_tokens) == (4, 4, 3)
    decode = StepPlan([ScheduledRequest("r", [5], 100, [0] * 7, True, params)])
    assert cost.price(totals)["total"] > cost.price(plan_totals(decode))["total"]
    # a verify-only step replays a CUDA graph as a decode step does: no per-layer launches
    assert cost.price(totals)["overhead"] == cost.price(plan_totals(decode))["overhead"]


def test_deployment_request_checks_the_speculative_fields():
    with pytest.raises(FieldError, match="spec_acceptance_rate"):
        DeploymentRequest(speculative_config={"method": "ngram", "num_speculative_tokens": 2}).build()
    with pytest.raises(FieldError, match="speculative_config.*num_speculative_tokens"):
        DeploymentRequest(speculative_config='{"method": "ngram"}', spec_acceptance_rate=0.5).build()
    d = DeploymentRequest(speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                          spec_acceptance_rate=0.5).build()
    assert d.to_json()["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2}


def test_fit_acceptance_rate_inverts_tokens_per_step():
    from servelab.lab.calibrate.spec_acceptance import fit_acceptance_rate, tokens_per_step

    assert tokens_per_step(0.0, 3) == 1 and tokens_per_step(1.0, 3) == 4
    assert abs(tokens_per_step(0.7, 3) - (1 + 0.7 + 0.49 + 0.343)) < 1e-12
    for rate in (0.1, 0.5, 0.9):
        assert abs(fit_acceptance_rate(tokens_per_step(rate, 4), 4) - rate) < 1e-9
    assert (fit_acceptance_rate(0.8, 4), fit_acceptance_rate(7.0, 4)) == (0.0, 1.0)
