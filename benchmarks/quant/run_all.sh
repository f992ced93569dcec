#!/bin/bash
# The quantization figures of the README, in one run (run it under the bench lock:
#   flock /work/bench.lock timeout 1800 bash benchmarks/quant/run_all.sh).
# Single-stream decode: llama.cpp's llama-bench tg128 on the default GGUF (Q4_1) beside servelab's
# bf16 and --quantization gguf; batched decode: 64 x (128 in, 64 out) per precision; perplexity last.
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
CLI="$PY -m servelab.entrypoints.cli"
THREADS=${THREADS:-$(nproc)}
BIN=${LLAMA_CPP_BIN:-$HOME/.cache/servelab/peers/llama.cpp-0.3.36/build/bin}
GGUF=$($PY -c "from servelab.model.loader import default_gguf_path; print(default_gguf_path())")
OUT=benchmarks/results/quant
mkdir -p $OUT
echo "load before: $(uptime)"
for rep in 1 2 3; do
  if [ -x "$BIN/llama-bench" ]; then
    "$BIN/llama-bench" -m "$GGUF" -p 0 -n 128 -t "$THREADS" -fa on -r 3 -o json > $OUT/llama-bench-tg128-q4_1-rep$rep.json
  fi
  for q in none gguf; do
    args=""; [ $q != none ] && args="--quantization $q"
    $CLI bench latency --batch-size 1 --input-len 32 --output-len 128 --num-iters 3 $args --name quant/latency-b1-$q-rep$rep > /dev/null
  done
done
for q in none gguf int8; do
  args=""; [ $q != none ] && args="--quantization $q"
  $CLI bench latency --batch-size 64 --input-len 128 --output-len 64 --num-iters 2 $args --name quant/latency-b64-$q > /dev/null
done
echo "load after decode runs: $(uptime)"
$CLI bench perplexity --name quant/perplexity-smollm2
echo "load after: $(uptime)"
