// The English sentences the lab API writes into its answers (the advisor's decisions, why a deployment does not
// fit), shown in the page's language. The API's bytes stay those of `servelab lab ... --json`, so the page reads
// each sentence back here: in English it shows the API's own text, in another language the `phrase.*` string
// with the numbers the sentence carries. A sentence whose wording changed shows as the API wrote it.
"use strict";

window.LabPhrases = (() => {
  const N = "[\\d,.]+";
  const PCT = "\\d+%";
  // [pattern, key], one clause of a decision's `why` each (the clauses are joined by "; ")
  const CLAUSES = [
    [`paged blocks on demand \\(peak (?<peak>${PCT}) of the pool\\)`, "phrase.kv.paged_peak"],
    ["reserving prompt \\+ max_tokens per request does not even fit here", "phrase.kv.reserve_no_fit"],
    [`paged blocks on demand: peak use (?<peak>${PCT}) of the pool, vs contiguous reservation of prompt \\+ ` +
      `max_tokens that leaves (?<waste>${PCT}) of it reserved but unused`, "phrase.kv.paged_vs_contiguous"],
    ["static batches cannot even reserve their KV here", "phrase.cb.static_no_fit"],
    [`admitting and retiring every step gives p99 TTFT (?<ttft>${N}) ms and (?<tps>${N}) tok/s`, "phrase.cb.continuous"],
    [`static batches of (?<n>\\d+) give p99 TTFT (?<ttft>${N}) ms and (?<tps>${N}) tok/s`, "phrase.cb.static"],
    [`TP (?<tp>\\d+): (?<weights>${N}) GiB of weights do not leave room for KV on one (?<gpu>\\S+) ` +
      `\\((?<memory>${N}) GiB\\)`, "phrase.tp.no_room"],
    [`TP (?<tp>\\d+) cuts the step time \\(p99 TPOT (?<tpot>${N}) ms\\)`, "phrase.tp.cuts_step"],
    [`(?<n>\\d+) single-GPU replicas give p99 TTFT (?<ttft>${N}) ms`, "phrase.tp.replicas"],
    [`the best smaller-TP shape \\((?<gpus>\\d+) GPUs, TP (?<tp>\\d+)\\) gives p99 TTFT (?<ttft>${N}) ms, ` +
      `p99 TPOT (?<tpot>${N}) ms, missing the targets`, "phrase.tp.smaller_missing"],
    [`the best smaller-TP shape \\((?<gpus>\\d+) GPUs, TP (?<tp>\\d+)\\) gives p99 TTFT (?<ttft>${N}) ms, ` +
      `p99 TPOT (?<tpot>${N}) ms`, "phrase.tp.smaller"],
    [`the weights take (?<share>${PCT}) of one GPU, so whole-model replicas avoid all-reduces per layer`, "phrase.tp.not_needed"],
    [`(?<p>\\d+):(?<d>\\d+) prefill:decode instances keep long prefills from stalling decode steps ` +
      `\\(p99 TTFT (?<ttft>${N}) ms, p99 TPOT (?<tpot>${N}) ms\\)`, "phrase.pd.split"],
    [`colocated gives p99 TTFT (?<ttft>${N}) ms, p99 TPOT (?<tpot>${N}) ms`, "phrase.pd.colocated"],
    ["(?<n>\\d+) instance\\(s\\) cannot be split into prefill and decode pools", "phrase.pd.cannot_split"],
    ["chunked prefill mixes both in each step", "phrase.pd.chunked"],
    [`the best split at (?<gpus>\\d+) GPUs \\((?<p>\\d+):(?<d>\\d+)\\) gives p99 TTFT (?<ttft>${N}) ms vs ` +
      `p99 TTFT (?<ttft2>${N}) ms colocated`, "phrase.pd.best_split"],
    [`(?<n>\\d+) instances run at (?<u>${PCT}) of decode capacity`, "phrase.scale.instances"],
    ["add or remove instances as the request rate moves, watching queue length and KV-cache use", "phrase.scale.how"],
    [`one instance carries the load at (?<u>${PCT}) of its decode capacity`, "phrase.scale.one"],
    ["there is nothing to scale down to", "phrase.scale.nothing"],
    // the same decision from a simulated autoscaled run (`lab advise --autoscale`)
    ["simulated, the autoscaler kept (?<low>\\d+) to (?<high>\\d+) replicas serving", "phrase.scale.sim_replicas"],
    [`(?<hours>${N}) GPU-hours against (?<fixed>${N}) for a fixed (?<n>\\d+) replicas`, "phrase.scale.sim_gpu_hours"],
    [`it saves (?<share>${N}%) of the GPU-hours`, "phrase.scale.sim_saves"],
    ["it saves no GPU-hours", "phrase.scale.sim_saves_none"],
    [`(?<att>${N}%) of requests meet the targets \\(fixed: (?<fixed>${N}%)\\)`, "phrase.scale.sim_attainment"],
    ["the fixed deployment meets the targets for more requests", "phrase.scale.sim_fixed_better"],
    [`the first token arrives after p50 (?<ttft>${N}) ms, the whole answer after (?<e2e>${N}) ms: streaming ` +
      `shows text (?<x>${N})x sooner`, "phrase.stream.sooner"],
  ].map(([pattern, key]) => [new RegExp(`^${pattern}$`), key]);

  // why a deployment does not fit (MemoryPlan.reason)
  const REASONS = [
    [`weights need (?<weights>${N}) GiB per GPU \\(TP (?<tp>\\d+)\\) and activations (?<activations>${N}) GiB, ` +
      `but a (?<gpu>.+) offers (?<usable>${N}) GiB: no room for the KV cache`, "phrase.fit.no_room"],
    [`after (?<weights>${N}) GiB of weights per GPU, the KV cache gets (?<kv>${N}) GiB = (?<tokens>${N}) tokens, ` +
      `fewer than the workload's largest request \\((?<largest>${N}) tokens\\)`, "phrase.fit.too_small"],
  ].map(([pattern, key]) => [new RegExp(`^${pattern}$`), key]);

  const DECISIONS = {
    "KV-cache management": "phrase.decision.kv", "Continuous batching": "phrase.decision.continuous",
    "Tensor-parallel sharding": "phrase.decision.tp", "Prefill/decode split": "phrase.decision.pd",
    "GPU autoscaling": "phrase.decision.autoscaling", "Token streaming": "phrase.decision.streaming",
  };

  const { t } = window.LabI18n;
  const english = () => window.LabI18n.lang() === "en";

  function translate(text, patterns) {
    for (const [pattern, key] of patterns) {
      const match = pattern.exec(text);
      if (match) return t(key, match.groups || {});
    }
    return text;
  }

  return {
    decision: (name) => (english() || !DECISIONS[name] ? name : t(DECISIONS[name])),
    why: (text) => (english() ? text : text.split("; ").map((c) => translate(c, CLAUSES)).join(t("phrase.separator"))),
    reason: (text) => (english() ? text : translate(text, REASONS)),
  };
})();
