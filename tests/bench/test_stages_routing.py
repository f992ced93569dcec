"""`bench stages --stages dp,prefix`: stage 6 and its least-loaded comparison are two-replica servers that differ only
in their router, opt-in beside the default evolution path, and compared by throughput and TTFT."""
import pytest

from servelab.bench.stages import STAGES, parse_stages, ratios, stage_flags
from servelab.gateway.config import ServerConfig


def test_stage_6_flags_differ_from_its_comparison_only_in_the_router():
    dp, prefix = stage_flags("dp", 16, 64, ""), stage_flags("prefix", 16, 64, "")
    assert prefix[prefix.index("--router") + 1] == "prefix" and dp[dp.index("--router") + 1] == "least-loaded"
    assert [f for f in dp if f != "least-loaded"] == [f for f in prefix if f != "prefix"]
    assert dp[dp.index("--data-parallel-size") + 1] == "2"
    assert parse_stages("dp,prefix") == ["dp", "prefix"] and "prefix" not in STAGES  # opt-in
    with pytest.raises(ValueError, match="dp, prefix"):
        parse_stages("routing")


def test_ratios_compare_prefix_routing_with_least_loaded():
    runs = [{"schedule": "dp", "output_throughput": 100.0, "median_ttft_ms": 80.0},
            {"schedule": "prefix", "output_throughput": 110.0, "median_ttft_ms": 40.0}]
    assert ratios(runs) == {"prefix_vs_dp_output_throughput": 1.1, "prefix_vs_dp_median_ttft": 0.5}


def test_server_config_takes_only_known_routers():
    assert ServerConfig(router="prefix").router == "prefix"
    with pytest.raises(ValueError, match="router must be one of least-loaded, prefix"):
        ServerConfig(router="random")
