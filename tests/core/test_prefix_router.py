"""The prefix router (core/prefix_router.py) on its own, and as the lab's load balancer: requests sharing a prefix
go where it was sent unless the load there outweighs it, and the simulated hit rate rises over least-loaded."""
import json

from servelab.core.block_hash import hash_token_blocks
from servelab.core.prefix_router import PrefixRouter
from servelab.lab.cli import main
from servelab.lab.sim.load_balancer import LoadBalancer


def hashes(prefix: int, num_blocks: int, suffix: int = 0) -> list[bytes]:
    return hash_token_blocks([prefix] * 16 * num_blocks + [suffix] * 16, 16)


class Inst:
    def __init__(self):
        self.num_outstanding = 0


def test_cached_blocks_beat_load_until_the_load_costs_more():
    r = PrefixRouter(capacity_blocks=1000, load_weight=2.0)
    a = hashes(7, 8, suffix=1)
    assert r.pick([0, 1], [0, 0], a) == 0  # nothing cached: ties go to the lowest index
    r.routed(1, a)
    b = hashes(7, 8, suffix=2)  # shares a's 8 prefix blocks
    assert r.num_cached_blocks(1, b) == 8 and r.num_cached_blocks(0, b) == 0
    assert r.pick([0, 1], [0, 3], b) == 1  # 1 + 2*3 = 7 < 9
    assert r.pick([0, 1], [0, 5], b) == 0  # 1 + 2*5 = 11 > 9
    assert r.pick([0, 1], [0, 4], b) == 0  # 9 = 9: the less loaded


def test_capacity_evicts_the_least_recently_routed_tail_first():
    r = PrefixRouter(capacity_blocks=10)
    a, b = hashes(1, 5), hashes(2, 5)  # 6 blocks each
    r.routed(0, a)
    r.routed(0, b)
    assert r.num_cached_blocks(0, b) == 6
    assert r.num_cached_blocks(0, a) == 4  # a's last two blocks went first
    r.forget(0)
    assert r.num_cached_blocks(0, b) == 0


def test_default_weight_is_the_mean_prefill_routed():
    r = PrefixRouter(capacity_blocks=100)
    assert r.weight() == 1.0
    r.routed(0, hashes(1, 5))  # 6 blocks to prefill
    r.routed(0, hashes(1, 5, suffix=9))  # 1 block to prefill
    assert r.weight() == 3.5


def test_balancer_sends_a_prefix_back_to_its_instance():
    instances = [Inst(), Inst(), Inst()]
    lb = LoadBalancer("prefix", instances, capacity_blocks=100)
    first = lb.pick(hashes(3, 4))
    first.num_outstanding += 1
    other = lb.pick(hashes(4, 4))
    assert other is not first
    first.num_outstanding = 0  # finished
    assert lb.pick(hashes(3, 4, suffix=5)) is first
    first.num_outstanding = 2  # busy: 1 block to prefill + 2 x 11/3 (the mean prefill) > 5 elsewhere
    assert lb.pick(hashes(3, 4, suffix=6)) is not first


def test_simulated_prefix_routing_raises_the_hit_rate(capsys):
    args = ["simulate", "--model", "llama-3.1-8b", "--gpu", "h100", "--num-gpus", "4", "--dataset", "prefix-shared",
            "--num-prefixes", "50", "--prefix-len", "2048", "--input-len", "128", "--output-len", "32",
            "--request-rate", "40", "--num-prompts", "300", "--json"]
    rates = {}
    for router in ("least-loaded", "prefix"):
        assert main([*args, "--router", router]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["deployment"]["router"] == router
        rates[router] = out["meters"]["prefix_cache"]["hit_rate"]
    assert rates["prefix"] > rates["least-loaded"] + 0.1
