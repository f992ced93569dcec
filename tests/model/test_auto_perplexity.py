"""The perplexity gate (bench perplexity's: within 3% of bf16 at ctx 512 and 256) for the mode --quantization auto
picks for the default model on this machine. Its int8 weights come from the cache after the first run."""
import pytest

from servelab.bench.perplexity import MAX_RELATIVE_GAP, TEXT, engine_perplexity
from servelab.engine.llm_engine import LLMEngine
from servelab.engine_args import EngineArgs

pytestmark = pytest.mark.slow
CTX = 512


@pytest.fixture(scope="module")
def engines():
    common = dict(max_model_len=CTX, num_kv_blocks=CTX // 16)
    bf16 = LLMEngine.from_engine_args(EngineArgs(dtype="bfloat16", quantization="none", **common))
    auto = LLMEngine.from_engine_args(EngineArgs(**common))  # every flag at its default
    return bf16, auto


@pytest.mark.parametrize("ctx", [512, 256])
def test_the_mode_auto_picks_passes_the_perplexity_gate(engines, ctx):
    bf16, auto = engines
    text = TEXT.read_text(encoding="utf-8")
    reference = engine_perplexity(bf16, text, ctx=ctx)["perplexity"]
    got = engine_perplexity(auto, text, ctx=ctx)["perplexity"]
    choice = auto.quantization_choice
    print(f"ctx {ctx}: bf16 {reference:.2f}, {choice.describe()}: {got:.2f} ({100 * (got / reference - 1):+.2f}%)")
    assert got <= reference * (1 + MAX_RELATIVE_GAP)
