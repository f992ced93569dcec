"""The reference set covers what users ask about: enough points from enough independent sources, each cited,
across precision, engine generation, context, prefill:decode ratio, vendor and load; rejected sources say why."""
import re

import pytest

from servelab.lab.api import DeploymentRequest
from servelab.lab.catalog.reference import (
    FIT_SOURCES, REFERENCE_DIR, ReferenceDataError, load_reference_points, to_simulation)
from servelab.lab.catalog.reference_files import (
    ENGINE_KEYS, context_bucket, format_readme, load_rejected, load_sources, main, parse_source, set_gaps, summary)

SOURCES = load_sources()
POINTS = [p for s in SOURCES for p in s.points]


def _version(text: str) -> tuple[int, ...]:
    m = re.search(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else ()


def test_at_least_100_points_from_12_sources():
    assert len(POINTS) >= 100
    assert len(SOURCES) >= 12
    assert len({s.url for s in SOURCES}) == len(SOURCES)  # one file per source document


def test_every_point_cites_url_table_and_version():
    for p in POINTS:
        assert p.source.url.startswith("https://") and p.source.where and p.engine_version, p.id
        assert p.deployment_flags["engine"] in ENGINE_KEYS, p.id


def test_fp8_on_h100_and_h200():
    fp8 = {p.gpu for p in POINTS if p.dtype == "fp8"}
    assert {"h100", "h200"} <= fp8


def test_vllm_v1_and_sglang_04():
    assert any(p.engine == "vllm" and _version(p.engine_version) >= (0, 8) for p in POINTS)
    assert all(p.deployment_flags["engine"] == "vllm" for p in POINTS
               if p.engine == "vllm" and _version(p.engine_version) >= (0, 8))
    assert any(p.engine == "sglang" and _version(p.engine_version) >= (0, 4) for p in POINTS)


def test_long_context():
    assert any(context_bucket(p) == ">=16k" for p in POINTS)
    assert any((p.workload.simulate.input_len or 0) >= 16000 for p in POINTS)


def test_prefill_decode_ratios_other_than_one_to_one():
    ratios = {p.disaggregation for p in POINTS if p.disaggregation}
    assert (1, 1) in ratios and any(pr != dr for pr, dr in ratios)


def test_amd_with_current_vllm():
    amd = [p for p in POINTS if p.gpu in ("mi300x", "mi325x")]
    assert amd and any(p.deployment_flags["engine"] == "vllm" for p in amd)


def test_batch_one_through_saturation():
    batch_one = [p for p in POINTS if p.workload.max_concurrency == 1]
    saturated = [p for p in POINTS if p.workload.request_rate == float("inf") and p.workload.max_concurrency is None]
    assert batch_one and saturated
    batches = {p.workload.max_concurrency for p in POINTS if p.workload.max_concurrency}
    assert {1, 8} <= batches and max(batches) >= 64


def test_values_read_off_figures_carry_a_tolerance():
    assert all(p.metric.tolerance and 0 < p.metric.tolerance < p.metric.value
               for p in POINTS if p.metric.read_from == "figure")


def test_fitted_sources_are_files_of_the_set():
    assert set(FIT_SOURCES) <= {s.id for s in SOURCES}
    assert [p.id for p in load_reference_points()] == [p.id for sid in FIT_SOURCES
                                                       for s in SOURCES if s.id == sid for p in s.points]


def test_rejected_sources_say_why_and_are_not_in_the_set():
    rejected = load_rejected()
    assert rejected and all(len(e["why"]) > 40 for e in rejected)
    assert not {e["url"] for e in rejected} & {s.url for s in SOURCES}


def test_readme_lists_every_source_and_is_the_generated_one():
    readme = (REFERENCE_DIR / "README.md").read_text()
    for s in SOURCES:
        assert f"`{s.id}`" in readme and s.url in readme, s.id
    assert readme == format_readme(), "run: python -m servelab.lab.catalog.reference_files --write-readme"


def test_source_header_must_name_its_file():
    doc = {"source": {"id": "other", "url": "https://x", "title": "t", "publisher": "p", "date": "d",
                      "engines": [], "hardware": [], "tables": "t"}, "points": []}
    with pytest.raises(ReferenceDataError, match="differs from the file name"):
        parse_source(doc, "mine")
    doc["source"].pop("tables")
    with pytest.raises(ReferenceDataError, match="misses tables"):
        parse_source(doc, "other")


def test_summary_counts_every_point_and_names_the_lab_gaps(capsys):
    s = summary()
    assert s["points"] == len(POINTS) == sum(s["by_source"].values()) == sum(s["by_precision"].values())
    assert s["lab_gaps"] == {g: sum(g in set_gaps(p) for p in POINTS) for g in s["lab_gaps"]}
    assert main([]) == 0
    assert f"{len(POINTS)} points from {len(SOURCES)} sources" in capsys.readouterr().out


def test_every_point_the_lab_can_take_builds_its_deployment_and_workload():
    for p in POINTS:
        if set_gaps(p):
            continue
        sim = to_simulation(p, num_prompts=8)
        d = DeploymentRequest(**sim.deployment.as_kwargs()).build()
        assert d.num_gpus == p.num_gpus, p.id
        assert sim.workload.num_prompts <= 8 and sim.metric == p.metric.name
