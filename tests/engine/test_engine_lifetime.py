"""An engine is freed by reference counting alone once its last user drops it: nothing it owns (the engine
core's stats sink, the grammar compiler's tokenizer factory) points back at it. A cycle would keep the model's
weights alive until Python's collector, which counts objects and not bytes, happened to run a full pass."""
import gc
import weakref

from servelab import LLM, SamplingParams


def test_a_dropped_engine_is_freed_without_the_garbage_collector(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, num_kv_blocks=32)
    llm.generate(["a prompt"], SamplingParams(max_tokens=3, temperature=0))  # stats sunk, grammars idle
    engine = weakref.ref(llm.engine)
    weights = weakref.ref(next(iter(llm.engine.executor.model.parameters())))
    gc.collect()
    gc.disable()
    try:
        del llm
        assert engine() is None and weights() is None
    finally:
        gc.enable()
