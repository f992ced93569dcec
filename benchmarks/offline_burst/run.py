"""Offline burst: 64 x (128 random prompt tokens, 64 out, ignore_eos) through LLM.generate, fresh prompts per run
(no prefix-cache hits). Usage: python benchmarks/offline_burst/run.py [int8|gguf|none] [runs]; for an A/B run it
alternately with PYTHONPATH=OTHER_CHECKOUT/src."""
import sys, time, random
from servelab.llm import LLM
from servelab.sampling_params import SamplingParams
quant = sys.argv[1] if len(sys.argv) > 1 else "int8"
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 2
kw = dict(max_num_seqs=64, max_num_batched_tokens=int(sys.argv[3]) if len(sys.argv) > 3 else 1024)
llm = LLM(quantization=None if quant == "none" else quant, **kw)
def make(seed):
    random.seed(seed)
    return [{"prompt_token_ids": [random.randrange(100, 40000) for _ in range(128)]} for _ in range(64)]
prompts = make(99)
sp = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)
llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
for r in range(reps):
    prompts = make(r)
    t0 = time.perf_counter(); outs = llm.generate(prompts, sp, use_tqdm=False); dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{quant} run {r}: {dt:.2f} s, {n/dt:.1f} out tok/s", flush=True)
