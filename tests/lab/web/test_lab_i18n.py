"""The lab's two language files (static/i18n/en.json, zh.json): the same keys and placeholders in both, every key
the pages, the scripts and the API use present in them, and the API's messages in the request's language."""
from __future__ import annotations

import http.client
import json
import re
from pathlib import Path

import httpx
import pytest

import servelab.lab.web as lab_web_package
from servelab.errors import FieldError
from servelab.lab.web.i18n import Message, error_message, request_language
from servelab.lab.web.routes import ASSETS, PAGES, STATIC_DIR

from lab_helpers import catalog_names, english_words

WEB_DIR = Path(lab_web_package.__file__).parent
REPO = Path(__file__).resolve().parents[3]
LANGUAGES = ("en", "zh")
PLACEHOLDER = re.compile(r"\{(\w+)\}")
CJK = re.compile(r"[\u4e00-\u9fff]")
# Keys the scripts build from parts (`stage.${n}.title`), listed here from the values those parts take.
STAGES = range(1, 7)
WALK_METERS = ("kv", "weights", "ttft", "tpot", "throughput", "decode", "slots", "queue", "goodput", "transfer",
               "hits")
WALK_CAUSES = ("batch", "continuous", "tp", "pd", "prefix", "back", "side")  # walkthrough.js causes(), and the fallback
DYNAMIC_KEYS = (
    [f"stage.{n}.{part}" for n in STAGES for part in ("title", "summary", "watch", "name")]
    + [f"tut.s{n}.{part}" for n in STAGES for part in ("change", "why", "meters", "decision", "limits")]
    + [f"meter.{m}" for m in ("kv", "weights", "decode", "slots", "ttft", "tpot", "goodput", "queue", "step",
                              "transfer")]
    + [f"walk.meter.{m}" for m in WALK_METERS]
    + [f"walk.move.{d}" for d in ("up", "down", "appear", "vanish")]
    + [f"in.note.{s}" for s in ("serial", "static", "continuous")]
    + [f"box.scheduler_{s}" for s in ("serial", "static", "continuous")]
    + [f"in.router_note.{r}" for r in ("round_robin", "least_loaded", "prefix")]  # lab.js routerKey()
    + [f"box.router_{r}" for r in ("least_loaded", "prefix")]
    + [f"bottleneck.{b}" for b in ("kv_cache", "weights", "decode_throughput", "batch_slots", "ttft", "tpot", "goodput",
                                   "preemptions", "queue", "step_time", "kv_transfer")]
    + ["walk.steady.pd.tpot"]
    + [f"as.part.{p}" for p in ("queued", "prefill", "kv_transfer", "decode_interference", "decode")]  # autoscale.js
    + [f"as.policy_{p}" for p in ("keda", "dynamo")]
)


def strings(lang: str) -> dict[str, str]:
    return json.loads((STATIC_DIR / "i18n" / f"{lang}.json").read_text(encoding="utf-8"))


def used_keys() -> set[str]:
    """Every key a page or a script names: data-i18n attributes, string literals shaped like a key in one of the
    files' namespaces (tables of keys included), plural keys of tn(), the API's message kinds and DYNAMIC_KEYS."""
    namespaces = {key.split(".")[0] for key in strings("en")}
    keys = set(DYNAMIC_KEYS)
    for page in PAGES.values():
        html = (STATIC_DIR / page).read_text(encoding="utf-8")
        keys |= set(re.findall(r'data-i18n(?:-html)?="([^"]+)"', html))
        for attrs in re.findall(r'data-i18n-attr="([^"]+)"', html):
            keys |= {pair.split(":")[1] for pair in attrs.split(";")}
    for script in STATIC_DIR.glob("*.js"):
        source = script.read_text(encoding="utf-8")
        plurals = set(re.findall(r'\btn\(\s*"([^"]+)"', source))  # tn("fmt.replicas", n): .one and .other
        keys |= {f"{key}.{form}" for key in plurals for form in ("one", "other")}
        keys |= set(re.findall(r'\bt\(\s*"([^"]+)"', source))
        for key in re.findall(r'"((?:[a-z0-9_]+\.)+[a-z0-9_]+)"', source):
            if key.split(".")[0] in namespaces and key not in plurals:
                keys.add(key)
    for module in WEB_DIR.glob("*.py"):
        source = module.read_text(encoding="utf-8")
        kinds = re.findall(r'(?:Message\(|_bad\(field, )"(\w+)"', source)  # raised here
        kinds += re.findall(r'\("(\w+)",\s*r"', source)  # read back from a lower layer's wording
        keys |= {f"api.{kind}" for kind in kinds}
    return keys


def test_both_files_have_the_same_keys_and_placeholders():
    en, zh = strings("en"), strings("zh")
    assert sorted(set(en) - set(zh)) == [] and sorted(set(zh) - set(en)) == []
    for key in en:
        assert en[key].strip() and zh[key].strip(), key
        if not key.startswith("api."):  # the API's messages are checked by rendering them below
            assert set(PLACEHOLDER.findall(en[key])) == set(PLACEHOLDER.findall(zh[key])), key


def test_every_key_the_pages_scripts_and_api_use_is_in_both_files():
    keys = used_keys()
    assert {"intro.tutorial", "walk.meter.weights", "phrase.stream.sooner", "api.not_a_multiple", "api.not_between",
            "api.busy", "api.invalid", "fmt.replicas.one", "tut.delta_measured", "tut.s5.limits"} <= keys  # each use
    for lang in LANGUAGES:
        assert sorted(keys - set(strings(lang))) == [], lang


def test_step_by_step_reasons_name_a_cause_and_a_meter():
    """walk.why.<cause>.<meter>[.<up|down|appear|vanish>]: a misspelt part would make a reason never shown."""
    for key in strings("en"):
        if key.startswith("walk.why."):
            parts = key.split(".")[2:]
            assert parts[0] in WALK_CAUSES, key
            assert parts[0] in ("back", "side") or (parts[1] in WALK_METERS and len(parts) <= 3), key
            assert len(parts) < 3 or parts[2] in ("up", "down", "appear", "vanish"), key


def test_chinese_strings_keep_only_technical_english():
    names = catalog_names()
    for key, text in strings("zh").items():
        if key.startswith("api."):  # field names and values; checked by rendering them below
            continue
        prose = PLACEHOLDER.sub(" ", re.sub(r"<[^>]+>", " ", re.sub(r"<code>.*?</code>", " ", text)))
        assert english_words(prose, names) == [], (key, text)
    assert english_words("the request body is not valid") == ["the", "request", "body", "is", "not", "valid"]


@pytest.mark.parametrize("accept, query, expected", [
    ("zh-CN,zh;q=0.9,en;q=0.8", None, "zh"),
    ("en-US,en;q=0.9,zh;q=0.5", None, "en"),
    ("fr-FR, zh;q=0.1", None, "zh"),
    ("zh;q=0, en;q=0.2", None, "en"),
    ("de", None, "en"),
    ("", None, "en"),
    (None, None, "en"),
    ("zh-TW;q=abc", None, "en"),
    ("zh-CN", "en", "en"),
    ("en", "zh-CN", "zh"),
    ("en", "klingon", "en"),
])
def test_request_language(accept, query, expected):
    assert request_language(query, accept) == expected


def test_a_lower_layer_error_whose_wording_changed_still_says_which_field():
    message = error_message(FieldError("{tp} must be odd, got 4", "tp"))
    assert message == Message("invalid", {"message": "tp must be odd, got 4", "param": "tp"})
    assert message.render("en") == "tp must be odd, got 4"
    assert message.render("zh") == "参数 tp 有误：tp must be odd, got 4"


# (body, param, English needle, Chinese needle): one per message kind the API can answer with
BAD_BODIES = [
    ({"num_prompts": 5001}, "num_prompts", "between 1 and 5000", "必须在 1 到 5000 之间"),
    ({"num_prompts": "10"}, "num_prompts", "must be an integer", "必须是整数"),
    ({"seed": -1}, "seed", "must be >= 0", "必须 >= 0"),
    ({"burstiness": "x"}, "burstiness", "finite number", "有限的数"),
    ({"burstiness": 0}, "burstiness", "> 0", "必须 > 0"),
    ({"gpu": "h900"}, "gpu", "must be one of", "之一"),
    ({"request_rate": "fast"}, "request_rate", '"inf"', "每秒请求数"),
    ({"range_ratio": 1}, "range_ratio", "[0, 1)", "之内"),
    ({"disaggregate": "2"}, "disaggregate", "P:D", "prefill 和 decode 实例数"),
    ({"colour": "red"}, "colour", "unknown field", "未知字段"),
    ({"input_len": 32768, "output_len": 8192, "num_prompts": 1000}, "num_prompts", "prompt + output tokens",
     "超过了 lab 每次 simulate 的上限"),
    ({"num_gpus": 4, "tp": 3}, "num_gpus", "not a multiple of tp 3", "不是 tp 3 的整数倍"),
    ({"model": "llama-3.1-8b", "num_gpus": 3, "tp": 3}, "tp", "does not divide", "不能整除"),
    ({"model": "llama-3.1-8b", "gpu": "l4", "num_gpus": 16, "tp": 16}, "tp", "spans more than one", "节点内互连"),
    ({"disaggregate": "1:1", "num_gpus": 3}, "disaggregate", "needs 2 GPUs", "需要 2 块 GPU"),
    ({"disaggregate": "1:1", "num_gpus": 2, "schedule": "static"}, "disaggregate", "continuous batching on each side",
     "每一侧都运行"),
    ({"dataset": "sharegpt-like", "input_len": 100}, "input_len", "own distribution", "自己的分布"),
    ({"model": "smollm2-135m", "input_len": 8192, "output_len": 512, "num_prompts": 2}, None, "context of",
     "上下文长度"),
]


def post(url: str, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{url}{path}", timeout=60, **kwargs)


@pytest.mark.parametrize("body, param, english, chinese", BAD_BODIES)
def test_the_api_answers_errors_in_the_requested_language(lab_web, body, param, english, chinese):
    en = post(lab_web.url, "/lab/api/simulate", json=body)
    zh_query = post(lab_web.url, "/lab/api/simulate?lang=zh", json=body)
    zh_header = post(lab_web.url, "/lab/api/simulate", json=body, headers={"Accept-Language": "zh-CN,zh;q=0.9"})
    assert en.status_code == zh_query.status_code == zh_header.status_code == 400, en.text
    assert en.json()["error"]["param"] == zh_query.json()["error"]["param"] == param
    assert english in en.json()["error"]["message"] and not CJK.search(en.json()["error"]["message"])
    message = zh_query.json()["error"]["message"]
    assert chinese in message and zh_header.json() == zh_query.json()
    assert not re.search(r"\b(must|got|needs|between|unknown|exceeds|divide|instances)\b", message), message


def test_body_and_busy_errors_in_chinese(lab_web):
    not_json = post(lab_web.url, "/lab/api/simulate?lang=zh", content=b"{model: 1",
                    headers={"Content-Type": "application/json"})
    assert not_json.status_code == 400
    assert not_json.json()["error"]["message"] == "请求体不是合法的 JSON（第 1 行第 2 列）"
    not_utf8 = post(lab_web.url, "/lab/api/simulate?lang=zh", content=b'{"model": "\xff"}')
    assert not_utf8.status_code == 400 and "UTF-8" in not_utf8.json()["error"]["message"]
    not_object = post(lab_web.url, "/lab/api/advise?lang=zh", json=[1])
    assert not_object.json()["error"]["message"] == "请求体必须是一个 JSON 对象"
    no_target = post(lab_web.url, "/lab/api/advise?lang=zh", json={"ttft_target_ms": None})
    assert no_target.json()["error"] == {"message": "advise 需要 ttft_target_ms（tpot_target_ms 可选）",
                                         "type": "invalid_request_error", "param": "ttft_target_ms", "code": None}
    too_big = post(lab_web.url, "/lab/api/simulate?lang=zh", json={"model": "x" * 70_000})
    assert too_big.status_code == 413
    assert too_big.json()["error"]["message"] == "请求体超过了 lab 的 65536 字节上限。"
    missing = httpx.get(f"{lab_web.url}/lab/static/nope.js?lang=zh", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "没有名为 'nope.js' 的 lab 资源"


def test_successful_answers_do_not_depend_on_the_language(lab_web):
    body = {"model": "llama-3.1-8b", "gpu": "h100", "num_prompts": 30, "request_rate": 4}
    plain = post(lab_web.url, "/lab/api/simulate", json=body)
    assert plain.status_code == 200
    assert post(lab_web.url, "/lab/api/simulate?lang=zh", json=body).content == plain.content
    chinese = post(lab_web.url, "/lab/api/simulate", json=body, headers={"Accept-Language": "zh-CN"})
    assert chinese.content == plain.content


def test_assets_are_exactly_the_listed_files_and_nothing_else_is_served(lab_web):
    shipped = {str(p.relative_to(STATIC_DIR)) for p in STATIC_DIR.rglob("*") if p.is_file()}
    assert shipped == set(ASSETS) | set(PAGES.values())
    for name, kind in ASSETS.items():
        response = httpx.get(f"{lab_web.url}/lab/static/{name}", timeout=10)
        assert response.status_code == 200 and response.headers["content-type"].startswith(kind), name
    connection = http.client.HTTPConnection("127.0.0.1", lab_web.port, timeout=10)
    for raw in ("/lab/static/../routes.py", "/lab/static/i18n/../../routes.py", "/lab/static/%2e%2e/routes.py",
                "/lab/static/i18n/%2e%2e/lab.js", "/lab/static//etc/passwd", "/lab/static/index.html",
                "/lab/static/i18n"):
        connection.request("GET", raw)
        response = connection.getresponse()
        body = response.read()
        assert response.status == 404 and b"servelab" not in body, raw
    connection.close()


def test_the_packaged_measurements_are_the_benchmarks_results():
    packaged = STATIC_DIR / "measured" / "stages.json"
    results = REPO / "benchmarks" / "stages" / "stages-smollm2" / "stages-smollm2.json"
    assert packaged.read_bytes() == results.read_bytes(), "copy the new results into lab/web/static/measured/"
