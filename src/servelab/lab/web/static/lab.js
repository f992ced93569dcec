// The servelab lab page: inputs -> POST /lab/api/simulate (and /advise) -> diagram, meters, decisions.
// Plain JS, no build step, no network beyond this server. Every string comes from LabI18n (i18n.js).
"use strict";

(() => {
  const RATES = [0.25, 0.5, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, "inf"];
  const INPUT_LENS = [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768];
  const OUTPUT_LENS = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192];
  const TTFT_TARGETS = [50, 100, 200, 300, 500, 750, 1000, 2000, 5000, 10000, 30000];
  const TPOT_TARGETS = [null, 5, 10, 15, 20, 30, 50, 100, 200];
  const SLOTS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512];
  const MAX_PAGE_GPUS = 64;
  const TPOT_SCALE_MS = 100; // full TPOT bar when no target is set
  const DEBOUNCE_MS = 30; // coalesces one gesture's events; pump() keeps one simulation in flight
  const ADVISE_SETTLE_MS = 500;
  const MAX_BUSY_RETRIES = 120;
  const DEPLOYMENT_FIELDS = ["num_gpus", "tp", "schedule", "disaggregate"];
  // the prefix-shared dataset's shape when the page has none yet (the stage-6 card's)
  const DEFAULT_PREFIX_LEN = 4096;
  const DEFAULT_NUM_PREFIXES = 64;

  const { t, tn, fmt } = window.LabI18n;
  const { num, pct, gib, ms } = fmt;
  const $ = (id) => document.getElementById(id);
  const state = {
    catalog: null, pending: false, inFlight: false, advising: false, debounce: null, adviseKey: null,
    simulations: 0,
    adviseWanted: null, advisePumping: false, advisingKey: null, // the advisor's queue of one (wantAdvice)
    last: null, // {body, result} of the simulation the meters show
    advice: null, adviceError: null, adviceBody: null, error: null,
    walk: null, // {stage, from} while a clicked card's simulation runs
    walkView: null, // {stage, from, to} the step-by-step panel explains
  };

  const memory = (bytes) => (bytes >= 2 ** 30 ? `${gib(bytes)} GiB` : `${num(bytes / 2 ** 20, 1)} MiB`);
  const rateLabel = (r) => (r === "inf" ? t("fmt.all_at_once") : t("fmt.req_s", { n: num(r, 2) }));

  // ---- list sliders: a range input over an index into a list of values
  function listSlider(id, values) {
    const el = $(id);
    el.max = String(values.length - 1);
    return {
      el,
      get: () => values[Number(el.value)],
      set: (value) => { el.value = String(nearestIndex(values, value)); },
    };
  }

  function nearestIndex(values, value) {
    const exact = values.indexOf(value);
    if (exact >= 0) return exact;
    let best = 0;
    values.forEach((v, i) => {
      if (typeof v === "number" && typeof value === "number" && value > 0 &&
          Math.abs(Math.log(v / value)) < Math.abs(Math.log(values[best] / value))) best = i;
    });
    return best;
  }

  const sliders = {
    rate: listSlider("in-rate", RATES),
    inputLen: listSlider("in-input-len", INPUT_LENS),
    outputLen: listSlider("in-output-len", OUTPUT_LENS),
    ttft: listSlider("in-ttft", TTFT_TARGETS),
    slots: listSlider("in-slots", SLOTS),
  };

  // ---- inputs <-> the API's JSON body
  function buildBody() {
    const continuous = $("sw-continuous").checked;
    const slots = sliders.slots.get();
    const tp = $("sw-tp").checked ? Number($("in-tp").value) : 1;
    const split = $("sw-pd").checked ? [intOf("in-prefill", 1), intOf("in-decode", 1)] : null;
    const dataset = $("in-dataset").value;
    const sharegpt = dataset === "sharegpt-like";
    const shared = dataset === "prefix-shared";
    const tpot = $("in-tpot").value;
    const spec = $("sw-spec").checked;
    return {
      model: $("in-model").value,
      gpu: $("in-gpu").value,
      num_gpus: Number($("in-gpus").value),
      tp,
      schedule: continuous ? "continuous" : (slots === 1 ? "serial" : "static"),
      disaggregate: split ? `${split[0]}:${split[1]}` : null,
      max_num_seqs: slots,
      router: $("in-router").value,
      request_rate: sliders.rate.get(),
      num_prompts: intOf("in-prompts", 400),
      input_len: sharegpt ? null : sliders.inputLen.get(),
      output_len: sharegpt ? null : sliders.outputLen.get(),
      range_ratio: Number($("in-range").value) || 0,
      dataset,
      prefix_len: shared ? intOf("in-prefix-len", DEFAULT_PREFIX_LEN) : null,
      num_prefixes: shared ? intOf("in-num-prefixes", DEFAULT_NUM_PREFIXES) : null,
      burstiness: Number($("in-burst").value) || 1,
      seed: intOf("in-seed", 0),
      ttft_target_ms: sliders.ttft.get(),
      tpot_target_ms: tpot === "" ? null : Number(tpot),
      speculative_config: spec ? { method: "ngram", num_speculative_tokens: Number($("in-spec-k").value) } : null,
      spec_acceptance_rate: spec ? Number($("in-spec-rate").value) : null,
    };
  }

  function intOf(id, fallback) {
    const value = parseInt($(id).value, 10);
    return Number.isFinite(value) ? value : fallback;
  }

  function setInputs(inputs) {
    $("in-model").value = inputs.model;
    $("in-gpu").value = inputs.gpu;
    sliders.rate.set(inputs.request_rate);
    if (inputs.input_len != null) sliders.inputLen.set(inputs.input_len);
    if (inputs.output_len != null) sliders.outputLen.set(inputs.output_len);
    sliders.ttft.set(inputs.ttft_target_ms ?? 500);
    $("in-tpot").value = inputs.tpot_target_ms == null ? "" : String(inputs.tpot_target_ms);
    $("sw-continuous").checked = inputs.schedule === "continuous";
    sliders.slots.set(inputs.schedule === "serial" ? 1 : (inputs.max_num_seqs ?? 256));
    $("sw-tp").checked = inputs.tp > 1;
    if (inputs.tp > 1) $("in-tp").value = String(inputs.tp);
    $("sw-pd").checked = Boolean(inputs.disaggregate);
    if (inputs.disaggregate) {
      const [p, d] = inputs.disaggregate.split(":");
      $("in-prefill").value = p;
      $("in-decode").value = d;
    }
    $("in-dataset").value = inputs.dataset;
    $("in-router").value = inputs.router ?? "round-robin";
    if (inputs.prefix_len != null) $("in-prefix-len").value = String(inputs.prefix_len);
    if (inputs.num_prefixes != null) $("in-num-prefixes").value = String(inputs.num_prefixes);
    if (inputs.dataset === "prefix-shared") document.querySelector("details.advanced").open = true; // its shape
    $("in-range").value = String(inputs.range_ratio);
    $("in-burst").value = String(inputs.burstiness);
    $("in-prompts").value = String(inputs.num_prompts);
    $("in-seed").value = String(inputs.seed);
    $("sw-spec").checked = Boolean(inputs.speculative_config);
    if (inputs.speculative_config) {
      $("in-spec-k").value = String(inputs.speculative_config.num_speculative_tokens);
      $("in-spec-rate").value = String(inputs.spec_acceptance_rate ?? 0.7);
    }
    syncControls(inputs.num_gpus);
  }

  // GPU count follows the switches: a multiple of the TP degree, or (P + D) x TP when disaggregated.
  function syncControls(wantedGpus) {
    const gpus = $("in-gpus");
    const tp = $("sw-tp").checked ? Number($("in-tp").value) : 1;
    const pd = $("sw-pd").checked;
    gpus.min = String(tp);
    gpus.step = String(tp);
    gpus.max = String(Math.max(MAX_PAGE_GPUS - (MAX_PAGE_GPUS % tp), tp));
    let value = wantedGpus ?? Number(gpus.value);
    if (pd) value = (intOf("in-prefill", 1) + intOf("in-decode", 1)) * tp;
    else value = Math.max(tp, Math.ceil(value / tp) * tp);
    gpus.value = String(value);
    gpus.disabled = pd;
    $("in-tp").closest(".sub").classList.toggle("disabled", tp === 1);
    $("in-prefill").closest(".sub").classList.toggle("disabled", !pd);
    $("in-spec-rate").closest(".sub").classList.toggle("disabled", !$("sw-spec").checked);
    const sharegpt = $("in-dataset").value === "sharegpt-like";
    $("prefix-shape").hidden = $("in-dataset").value !== "prefix-shared";
    sliders.inputLen.el.disabled = sharegpt;
    sliders.outputLen.el.disabled = sharegpt;
    updateLabels();
  }

  function updateLabels() {
    const body = buildBody();
    $("out-rate").textContent = rateLabel(body.request_rate);
    const tokens = (n) => (n == null ? "sharegpt-like" : t("fmt.tokens", { n: num(n) }));
    $("out-input-len").textContent = body.prefix_len == null ? tokens(body.input_len)
      : t("fmt.tokens_after_prefix", { n: num(body.input_len), prefix: num(body.prefix_len) });
    $("out-output-len").textContent = tokens(body.output_len);
    $("out-ttft").textContent = ms(body.ttft_target_ms);
    $("out-slots").textContent = String(body.max_num_seqs);
    let shape = tn("fmt.replicas", body.num_gpus / body.tp);
    if (body.disaggregate) {
      const [p, d] = body.disaggregate.split(":");
      shape = t("fmt.split", { p, d });
    }
    $("out-gpus").textContent = body.tp > 1 ? t("fmt.gpus_shape_tp", { n: body.num_gpus, shape, tp: body.tp })
      : t("fmt.gpus_shape", { n: body.num_gpus, shape });
    $("schedule-note").textContent = t(`in.note.${body.schedule}`, { n: body.max_num_seqs });
    $("router-note").textContent = routerNote(body);
    // a draft per position accepted with probability a until one is not: (1 - a^(K+1)) / (1 - a) tokens a step
    const a = Number($("in-spec-rate").value), k = Number($("in-spec-k").value);
    const perStep = a >= 1 ? k + 1 : (1 - a ** (k + 1)) / (1 - a);
    $("out-spec-rate").textContent = t("fmt.spec_rate", { a: a.toFixed(2), n: perStep.toFixed(2) });
    $("cli-command").textContent = cliCommand(body);
  }

  // what the router chooses between: replicas, or the prefill instances of a split
  function routed(body) {
    return body.disaggregate ? Number(body.disaggregate.split(":")[0]) : body.num_gpus / body.tp;
  }

  const routerKey = (router) => router.replace("-", "_");

  function routerNote(body) {
    const n = routed(body);
    if (n < 2) return t("in.router_note.one");
    return t(`in.router_note.${routerKey(body.router)}`, { replicas: tn(body.disaggregate ? "fmt.instances" : "fmt.replicas", n) });
  }

  function cliCommand(b) {
    const parts = ["servelab lab simulate", `--model ${b.model}`, `--gpu ${b.gpu}`, `--num-gpus ${b.num_gpus}`,
      `--tp ${b.tp}`, `--schedule ${b.schedule}`];
    if (b.disaggregate) parts.push(`--disaggregate ${b.disaggregate}`);
    parts.push(`--max-num-seqs ${b.max_num_seqs}`, `--router ${b.router}`, `--dataset ${b.dataset}`);
    if (b.prefix_len != null) parts.push(`--prefix-len ${b.prefix_len}`, `--num-prefixes ${b.num_prefixes}`);
    if (b.input_len != null) parts.push(`--input-len ${b.input_len}`);
    if (b.output_len != null) parts.push(`--output-len ${b.output_len}`);
    parts.push(`--range-ratio ${b.range_ratio}`, `--request-rate ${b.request_rate}`, `--burstiness ${b.burstiness}`,
      `--num-prompts ${b.num_prompts}`, `--seed ${b.seed}`, `--ttft-target ${b.ttft_target_ms}ms`);
    if (b.tpot_target_ms != null) parts.push(`--tpot-target ${b.tpot_target_ms}ms`);
    if (b.speculative_config) {
      parts.push(`--speculative-config '${JSON.stringify(b.speculative_config)}'`,
        `--spec-acceptance-rate ${b.spec_acceptance_rate}`);
    }
    parts.push("--json");
    return parts.join(" ");
  }

  // the latest stage the inputs reach: the prefix router once it has replicas (or prefill instances) to choose from
  function stageOf(body) {
    if (body.router === "prefix" && routed(body) > 1) return 6;
    if (body.disaggregate) return 5;
    if (body.tp > 1) return 4;
    return { continuous: 3, static: 2, serial: 1 }[body.schedule];
  }

  function sameInputs(a, b) {
    return Object.keys(b).every((k) => JSON.stringify(a[k] ?? null) === JSON.stringify(b[k] ?? null));
  }

  // ---- running simulations: one request in flight; newer inputs wait for it, then run once. The advisor runs in
  // the lab's other worker, so a redraw never waits behind its search.
  function scheduleRun(delay = DEBOUNCE_MS) {
    clearTimeout(state.debounce);
    $("meters").dataset.status = "pending";
    state.debounce = setTimeout(() => { state.pending = true; pump(); }, delay);
  }

  async function pump() {
    if (state.inFlight) return;
    state.inFlight = true;
    try {
      while (state.pending) {
        state.pending = false;
        const body = buildBody();
        await simulate(body);
        if (!state.pending) wantAdvice(adviseBodyOf(body));
      }
    } finally {
      state.inFlight = false;
    }
  }

  // The advisor, for the inputs the meters show once they have stayed ADVISE_SETTLE_MS: one search at a time, and
  // while one runs only the latest inputs wait for it.
  function wantAdvice(body) {
    const key = JSON.stringify(body);
    if (key === (state.advising ? state.advisingKey : state.adviseKey)) {
      state.adviseWanted = null;
      if (!state.advising) markAdviceStale(false);
      return;
    }
    state.adviseWanted = { body, key, at: performance.now() };
    markAdviceStale(true);
    advisePump();
  }

  async function advisePump() {
    if (state.advisePumping) return;
    state.advisePumping = true;
    try {
      while (state.adviseWanted) {
        const wanted = state.adviseWanted;
        const wait = wanted.at + ADVISE_SETTLE_MS - performance.now();
        if (wait > 0 || state.pending || state.inFlight) { // newer inputs may replace it meanwhile
          await sleep(Math.max(wait, DEBOUNCE_MS));
          continue;
        }
        state.adviseWanted = null;
        await advise(wanted.body, wanted.key);
      }
    } finally {
      state.advisePumping = false;
    }
  }

  const sleep = (ms_) => new Promise((resolve) => setTimeout(resolve, ms_));

  async function callLab(command, body, statusEl) {
    for (let attempt = 0; attempt <= MAX_BUSY_RETRIES; attempt++) {
      const response = await fetch(window.LabI18n.api(`/lab/api/${command}`), {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
      });
      if (response.status === 429) {
        statusEl.replaceChildren(window.LabI18n.keyed("status.waiting"));  // re-translated on a switch while it waits
        await sleep(1000 * Number(response.headers.get("Retry-After") || 1));
        continue;
      }
      const payload = await response.json();
      if (!response.ok) {
        const error = payload.error || {};
        const message = error.message || response.statusText;
        throw new Error(error.param ? t("error.with_field", { message, param: error.param }) : message);
      }
      return payload;
    }
    throw new Error(t("error.busy"));
  }

  async function simulate(body) {
    const status = $("run-status");
    status.className = "run-status busy";
    status.textContent = t("status.simulating");
    $("meters").dataset.status = "busy";
    const started = performance.now();
    try {
      const result = await callLab("simulate", body, status);
      hideError();
      render(body, result);
      const seconds = (performance.now() - started) / 1000;
      state.last = { body, result, seconds };
      status.className = "run-status";
      status.textContent = t("status.simulated", { s: num(seconds, 2) });
      finishWalk(body, result);
      $("meters").dataset.body = JSON.stringify(body);
      $("meters").dataset.runs = String(++state.simulations);
      $("meters").dataset.status = "ready";
    } catch (err) {
      showError(t("error.not_run", { message: err.message }));
      status.className = "run-status";
      status.textContent = "";
      $("meters").dataset.status = "error";
    }
  }

  function showError(message) {
    state.error = message;
    const banner = $("error-banner");
    banner.textContent = message;
    banner.hidden = false;
  }

  function hideError() {
    state.error = null;
    $("error-banner").hidden = true;
  }

  // ---- meters
  const METERS = ["kv", "weights", "decode", "slots", "ttft", "tpot", "goodput", "queue", "step", "transfer"];

  function buildMeters() {
    const list = $("meter-list");
    for (const id of METERS) {
      const el = document.createElement("div");
      el.className = "meter";
      el.id = `meter-${id}`;
      el.innerHTML = `<div class="meter-head"><span class="meter-name" data-i18n="meter.${id}"></span>` +
        `<span class="badge" data-i18n="meter.bottleneck"></span></div>` +
        `<div class="bar"><div class="fill"></div></div><div class="meter-value">–</div>`;
      list.appendChild(el);
    }
    window.LabI18n.apply(list);
  }

  // spec: {value, fill, marks: [[at, cls]], segments: [[share, color]], text, bottleneck, na, hidden}
  function setMeter(id, spec) {
    const el = $(`meter-${id}`);
    el.hidden = Boolean(spec.hidden);
    el.classList.toggle("bottleneck", Boolean(spec.bottleneck));
    el.classList.toggle("na", Boolean(spec.na));
    el.classList.toggle("over", (spec.fill ?? 0) > 1);
    el.dataset.value = spec.value == null ? "" : String(spec.value);
    const bar = el.querySelector(".bar");
    bar.querySelectorAll(".mark, .seg").forEach((node) => node.remove());
    const fill = bar.querySelector(".fill");
    fill.style.width = `${Math.max(0, Math.min(1, spec.fill ?? 0)) * 100}%`;
    fill.hidden = Boolean(spec.segments);
    let left = 0;
    for (const [share, color] of spec.segments || []) {
      const seg = document.createElement("div");
      seg.className = "seg";
      seg.style.left = `${left * 100}%`;
      seg.style.width = `${share * 100}%`;
      seg.style.background = color;
      bar.appendChild(seg);
      left += share;
    }
    for (const [at, cls] of spec.marks || []) {
      const mark = document.createElement("div");
      mark.className = `mark ${cls || ""}`;
      mark.style.left = `calc(${Math.min(1, at) * 100}% - 1px)`;
      bar.appendChild(mark);
    }
    el.querySelector(".meter-value").textContent = spec.text;
  }

  // A latency bar: full at twice the target, the target mark in the middle, p50 as a white tick.
  function latencySpec(meter, label) {
    const scale = meter.target_ms ? 2 * meter.target_ms : (label === "tpot" ? TPOT_SCALE_MS : meter.p99_ms || 1);
    const marks = [[meter.median_ms / scale, "p50"]];
    if (meter.target_ms) marks.push([0.5, "target"]);
    let text = t("meter.latency", { p50: ms(meter.median_ms), p99: ms(meter.p99_ms) });
    text += meter.target_ms ? t("meter.latency_target", { target: ms(meter.target_ms) }) : t("meter.no_target");
    if (meter.attainment != null) text += t("meter.attainment", { share: pct(meter.attainment) });
    return { value: meter.p99_ms, fill: Math.min(meter.p99_ms / scale, 1.0001), marks, text, bottleneck: meter.bottleneck };
  }

  const STEP_COLORS = { weights: "#2f6fde", attention: "#7fa8ef", communication: "#e0873a", overhead: "#a3acb9" };

  function renderMeters(body, r) {
    const m = r.meters;
    if (!r.fits) {
      const w = m.weights;
      setMeter("weights", {
        value: w.bytes_per_gpu, fill: w.share_of_memory, marks: [[w.usable_bytes / w.memory_bytes, "target"]],
        bottleneck: true,
        text: t("meter.weights_no_fit", { weights: gib(w.bytes_per_gpu), tp: body.tp, usable: gib(w.usable_bytes),
          memory: gib(w.memory_bytes), activations: gib(w.activation_bytes), kv: gib(w.kv_cache_bytes_per_gpu),
          tokens: num(w.kv_cache_tokens), largest: num(w.max_request_tokens) }),
      });
      for (const id of METERS) {
        if (id !== "weights") setMeter(id, { na: true, text: t("meter.not_simulated"), hidden: id === "transfer" });
      }
      return;
    }
    const kv = m.kv_cache;
    let kvText = t("meter.kv_text", { peak: pct(kv.peak_usage), mean: pct(kv.mean_usage), blocks: num(kv.num_blocks),
      tokens: num(kv.num_blocks * kv.block_size) });
    if (kv.reserved_unused_share != null) kvText += t("meter.kv_unused", { share: pct(kv.reserved_unused_share) });
    kvText += ` · ${tn("fmt.preemptions", kv.num_preemptions)}`;
    setMeter("kv", { value: kv.peak_usage, fill: kv.peak_usage, marks: [[0.9, "target"]], text: kvText, bottleneck: kv.bottleneck });

    const w = m.weights;
    let wText = t("meter.weights_text", { weights: gib(w.bytes_per_gpu), memory: gib(w.bytes_per_gpu / w.share_of_memory),
      share: pct(w.share_of_memory) });
    if (body.tp > 1) wText += t("meter.weights_tp", { whole: gib(w.bytes_per_gpu * body.tp), tp: body.tp });
    wText += t("meter.weights_kv", { kv: gib(w.kv_cache_bytes_per_gpu) });
    setMeter("weights", { value: w.bytes_per_gpu, fill: w.share_of_memory, marks: [[0.75, "target"]], text: wText, bottleneck: w.bottleneck });

    const d = m.decode_throughput;
    const demanded = d.demanded_tokens_per_s != null;
    setMeter("decode", {
      value: d.utilization, fill: Math.min(d.utilization, 1.0001), marks: [[0.9, "target"]], bottleneck: d.bottleneck,
      text: t(demanded ? "meter.decode_demanded" : "meter.decode_served", {
        tps: num(demanded ? d.demanded_tokens_per_s : d.served_tokens_per_s), capacity: num(d.capacity_tokens_per_s),
        share: pct(d.utilization) }),
    });

    const s = m.batch_slots;
    setMeter("slots", {
      value: s.mean_saturation, fill: s.mean_saturation, bottleneck: s.bottleneck,
      text: t("meter.slots_text", { mean: num(s.mean_running, 1), peak: num(s.peak_running), slots: num(s.max_num_seqs),
        full: pct(s.full_with_waiting_share) }),
    });

    setMeter("ttft", latencySpec(m.ttft, "ttft"));
    setMeter("tpot", latencySpec(m.tpot, "tpot"));

    const g = m.goodput;
    const hasTargets = body.ttft_target_ms != null || body.tpot_target_ms != null;
    setMeter("goodput", {
      value: g.slo_attainment, fill: g.slo_attainment, marks: [[0.99, "target"]], bottleneck: g.bottleneck,
      text: hasTargets ? t("meter.goodput_text", { rps: num(g.requests_per_s, 2), share: pct(g.slo_attainment) })
        : t("meter.goodput_no_targets", { rps: num(g.requests_per_s, 2) }),
    });

    const q = m.queue;
    setMeter("queue", {
      value: q.mean_queue_ms, fill: q.share_of_ttft, marks: [[0.5, "target"]], bottleneck: q.bottleneck,
      text: t("meter.queue_text", { wait: ms(q.mean_queue_ms), share: pct(q.share_of_ttft),
        peak: tn("fmt.requests_waiting", q.peak_waiting) }),
    });

    const st = m.step_time;
    const parts = ["weights", "attention", "communication", "overhead"];
    setMeter("step", {
      value: st.mean_step_ms, bottleneck: st.bottleneck,
      segments: parts.map((k) => [st[`${k}_share`] || 0, STEP_COLORS[k]]),
      text: t("meter.step_text", { step: num(st.mean_step_ms, 2), weights: pct(st.weights_share || 0),
        attention: pct(st.attention_share || 0), comm: pct(st.communication_share || 0),
        overhead: pct(st.overhead_share || 0) }),
    });

    const x = m.kv_transfer;
    setMeter("transfer", x ? {
      value: x.mean_ms, fill: x.share_of_ttft, marks: [[0.5, "target"]], bottleneck: x.bottleneck,
      text: t("meter.transfer_text", { mean: ms(x.mean_ms), p99: ms(x.p99_ms), share: pct(x.share_of_ttft) }),
    } : { hidden: true, text: "" });
  }

  // the API's meter groups -> the bottleneck line's names
  const BOTTLENECKS = ["kv_cache", "weights", "decode_throughput", "batch_slots", "ttft", "tpot", "goodput",
    "preemptions", "queue", "step_time", "kv_transfer"];

  function render(body, r) {
    renderMeters(body, r);
    const line = $("bottleneck-line");
    const notFit = $("does-not-fit");
    if (!r.fits) {
      notFit.hidden = false;
      notFit.replaceChildren();
      const title = document.createElement("strong");
      title.textContent = t("fit.title");
      notFit.append(title, window.LabPhrases.reason(r.reason));
      line.className = "bottleneck-line flagged";
      line.textContent = t("fit.bottleneck");
      $("summary-line").textContent = "";
    } else {
      notFit.hidden = true;
      const flagged = Object.entries(r.meters).filter(([, v]) => v && v.bottleneck)
        .map(([k]) => (BOTTLENECKS.includes(k) ? t(`bottleneck.${k}`) : k));
      line.className = `bottleneck-line ${flagged.length ? "flagged" : "clear"}`;
      line.textContent = flagged.length ? t("bottleneck.line", { names: flagged.join(t("fmt.list_separator")) })
        : t("bottleneck.none");
      const x = r.metrics;
      $("summary-line").textContent = t("meter.summary", { tps: num(x.output_throughput), rps: num(x.request_throughput, 2),
        e2e: ms(x.median_e2el_ms), completed: num(x.completed), duration: num(x.duration, 1) });
    }
    renderErrorBands(r);
    renderDiagram(body, r);
    renderLiveNote(body);
    renderStageCards(body);
  }

  // ---- each headline figure with its error band and the engine whose overheads priced it
  const BANDED = [["bands.ttft", "median_ttft_ms", ms], ["bands.tpot", "median_tpot_ms", ms],
    ["bands.throughput", "output_throughput", (v) => `${num(v)} tok/s`]];

  function regimeWords(matched) {
    return Object.entries(matched).map(([k, v]) => (k === "load" ? t(`bands.load_${v}`) : k === "precision" ? v.toUpperCase() : v))
      .join(t("fmt.list_separator"));
  }

  function renderErrorBands(r) {
    const box = $("error-bands");
    box.hidden = !(r.fits && r.error_bands);
    if (box.hidden) return;
    $("bands-title").textContent = t("bands.title", { engine: r.engine });
    const c = r.error_bands.calibration;
    $("bands-lead").textContent = t("bands.lead", { name: c.name, held: pct(c.held_out_mean_abs_error),
      fitted: pct(c.fitted_mean_abs_error), points: num(c.num_points), sources: num(c.num_sources) });
    const items = BANDED.filter(([, key]) => r.error_bands.metrics[key]).map(([label, key, fmt]) => {
      const b = r.error_bands.metrics[key];
      const regime = regimeWords(b.matched);
      const li = document.createElement("li");
      li.dataset.metric = key;
      li.textContent = t("bands.line", { metric: t(label), value: fmt(r.metrics[key]),
        band: b.band == null ? t("bands.none", { regime }) : t("bands.band", { pct: pct(b.band), regime, n: b.num_points }) });
      return li;
    });
    $("bands-list").replaceChildren(...items);
  }

  // ---- the diagram: [id, x, y, width] of each box, 58 high
  const SVG_NS = "http://www.w3.org/2000/svg";
  const BOX_PADDING = 5;
  const BOXES = [
    ["clients", 10, 112, 130], ["gateway", 166, 112, 130], ["scheduler", 322, 112, 140], ["prefill", 496, 18, 150],
    ["workers", 496, 112, 150], ["kv", 676, 112, 160], ["shards", 496, 206, 150], ["metrics", 322, 230, 140],
  ];

  function buildDiagram() {
    const holder = $("boxes");
    for (const [id, x, y, width] of BOXES) {
      const box = document.createElementNS(SVG_NS, "g");
      box.id = `box-${id}`;
      box.setAttribute("class", "box");
      box.setAttribute("transform", `translate(${x},${y})`);
      const rect = document.createElementNS(SVG_NS, "rect");
      for (const [k, v] of Object.entries({ width, height: 58, rx: 10 })) rect.setAttribute(k, String(v));
      box.appendChild(rect);
      for (const [cls, line] of [["box-title", 24], ["box-sub", 44]]) {
        const node = document.createElementNS(SVG_NS, "text");
        node.id = `${cls === "box-title" ? "title" : "sub"}-${id}`;
        node.setAttribute("class", cls);
        node.setAttribute("x", String(width / 2));
        node.setAttribute("y", String(line));
        box.appendChild(node);
      }
      holder.appendChild(box);
    }
  }

  // SVG text does not wrap: a label wider than its box (some languages' labels are) is squeezed to fit.
  function fitText(node, text, width) {
    node.textContent = text;
    node.removeAttribute("textLength");
    node.removeAttribute("lengthAdjust");
    const room = width - 2 * BOX_PADDING;
    if (node.getComputedTextLength() > room) {
      node.setAttribute("textLength", String(room));
      node.setAttribute("lengthAdjust", "spacingAndGlyphs");
    }
  }

  function setBox(id, on, isNew, title, sub, bottleneck = false) {
    const box = $(`box-${id}`);
    box.classList.toggle("on", on);
    box.classList.toggle("off", !on);
    box.classList.toggle("new", on && isNew);
    box.classList.toggle("bottleneck", bottleneck);
    box.dataset.state = on ? "active" : "idle";
    const width = BOXES.find(([name]) => name === id)[3];
    fitText($(`title-${id}`), title, width);
    fitText($(`sub-${id}`), sub, width);
    const note = document.querySelector(`#diagram-notes li[data-box="${id}"]`);
    if (note) note.classList.toggle("off", !on);
  }

  function setLink(id, on) {
    $(id).classList.toggle("on", on);
  }

  function renderDiagram(body, r) {
    const stage = stageOf(body);
    const m = r && r.fits ? r.meters : null;
    const split = body.disaggregate ? body.disaggregate.split(":").map(Number) : null;
    const instances = body.num_gpus / body.tp;
    const paged = body.schedule === "continuous";
    const weights = r ? r.meters.weights : null;
    $("stage-label").textContent = t("arch.stage_label", { n: stage, name: t(`stage.${stage}.name`) });
    $("architecture").dataset.stage = String(stage);

    setBox("clients", true, false, t("box.clients"), rateLabel(body.request_rate));
    // the router in front of the replicas, with the prefix cache's hit rate when the workload shares prefixes
    let gatewaySub = routed(body) > 1 && body.router !== "round-robin" ? t(`box.router_${routerKey(body.router)}`)
      : t("box.gateway_sub");
    if (m && m.prefix_cache) gatewaySub += t("box.prefix_hits", { share: pct(m.prefix_cache.hit_rate) });
    setBox("gateway", true, stage === 6, t("box.gateway"), gatewaySub);
    setBox("scheduler", true, stage <= 3, t("box.scheduler"), t(`box.scheduler_${body.schedule}`, { n: body.max_num_seqs }),
      Boolean(m && (m.batch_slots.bottleneck || m.queue.bottleneck)));
    setBox("prefill", Boolean(split), stage === 5, t("box.prefill"),
      split ? t("box.prefill_on", { instances: tn("fmt.instances", split[0]), tp: body.tp }) : t("box.prefill_off"));
    const workerSub = split ? tn("fmt.decode_instances", split[1])
      : t("box.workers_sub", { replicas: tn("fmt.replicas", instances), gpus: tn("fmt.gpus", body.tp) });
    const weightsFlag = Boolean(r && (!r.fits || r.meters.weights.bottleneck));
    setBox("workers", true, false, t("box.workers"), workerSub,
      Boolean((m && m.decode_throughput.bottleneck) || (weightsFlag && body.tp === 1)));
    let kvSub = t(paged ? "box.kv_paged" : (body.schedule === "serial" ? "box.kv_serial" : "box.kv_contiguous"));
    if (m) kvSub += t("box.kv_peak", { peak: pct(m.kv_cache.peak_usage) });
    setBox("kv", true, stage === 2 || stage === 3, t(paged ? "box.kv_title_paged" : "box.kv_title"), kvSub,
      Boolean(m && m.kv_cache.bottleneck));
    let shardsSub = t("box.shards_off");
    if (body.tp > 1) shardsSub = weights ? t("box.shards_on_gib", { tp: body.tp, gib: gib(weights.bytes_per_gpu) }) : `TP ${body.tp}`;
    setBox("shards", body.tp > 1, stage === 4, t("box.shards"), shardsSub, weightsFlag && body.tp > 1);
    setBox("metrics", true, false, t("box.metrics"), t("box.metrics_sub"));
    setLink("link-scheduler-prefill", Boolean(split));
    setLink("link-prefill-workers", Boolean(split));
    setLink("link-workers-shards", body.tp > 1);
    $("label-handoff").classList.toggle("off", !split);
  }

  // ---- evolution cards and their step-by-step explanation
  function buildStageCards() {
    const holder = $("stage-cards");
    for (const preset of state.catalog.presets) {
      const n = preset.stage;
      const card = document.createElement("button");
      card.type = "button";
      card.className = "stage-card";
      card.id = `stage-card-${n}`;
      card.dataset.stage = String(n);
      card.innerHTML = `<span class="num">${n}</span><span class="title" data-i18n="stage.${n}.title"></span>` +
        `<p class="summary" data-i18n="stage.${n}.summary"></p><p class="watch" data-i18n="stage.${n}.watch"></p>`;
      card.addEventListener("click", () => selectStage(preset));
      holder.appendChild(card);
    }
    window.LabI18n.apply(holder);
    labelPresets();
  }

  // the "preset" tag that CSS draws on the card whose inputs are the preset's
  function labelPresets() {
    document.querySelectorAll(".stage-card").forEach((card) => { card.dataset.presetLabel = t("path.preset"); });
  }

  function selectStage(preset) {
    state.walk = { stage: preset.stage, from: state.last };
    setInputs(preset.inputs);
    renderStageCards(buildBody());
    renderDiagram(buildBody(), null);
    scheduleRun(0);
  }

  function finishWalk(body, result) {
    if (!state.walk) return;
    const preset = state.catalog.presets.find((p) => p.stage === state.walk.stage);
    if (!sameInputs(body, preset.inputs)) return; // a newer input change: not the card's run
    state.walkView = { ...state.walk, to: { body, result } };
    state.walk = null;
    window.LabWalkthrough.render(state.walkView);
  }

  function renderStageCards(body) {
    const stage = stageOf(body);
    for (const preset of state.catalog.presets) {
      const card = $(`stage-card-${preset.stage}`);
      card.classList.toggle("current", preset.stage === stage);
      card.classList.toggle("selected", sameInputs(body, preset.inputs));
    }
  }

  // ---- the advisor
  function adviseBodyOf(body) {
    const out = {};
    for (const [k, v] of Object.entries(body)) if (!DEPLOYMENT_FIELDS.includes(k)) out[k] = v;
    // The advisor searches continuous-batching shapes: give it the engine's default slots unless the page uses them.
    if (body.schedule !== "continuous") out.max_num_seqs = null;
    out.max_gpus = Math.min(state.catalog.limits.max_gpus, MAX_PAGE_GPUS);
    // Once the autoscaling panel has run, the advisor answers `lab advise --autoscale ... --rate-schedule ...`
    // for its settings: the recommended shape autoscaled over the schedule, which the GPU autoscaling line cites.
    return { ...out, ...(window.LabAutoscale ? window.LabAutoscale.adviseFields() : null) };
  }

  function markAdviceStale(stale) {
    $("recommendation").classList.toggle("stale", stale);
    $("decisions").classList.toggle("stale", stale);
  }

  async function advise(body, key) {
    const status = $("advice-status");
    status.className = "run-status busy";
    status.replaceChildren(window.LabI18n.keyed("status.advising")); // re-translated on a switch while it runs
    $("advice").dataset.status = "busy";
    state.advising = true;
    state.advisingKey = key;
    let answer = null, error = null;
    try {
      answer = await callLab("advise", body, status);
    } catch (err) {
      error = err.message;
    }
    state.advising = false;
    state.advice = answer;
    state.adviceError = error;
    state.adviceBody = body;
    if (answer) state.adviseKey = key;
    renderAdvice();
    if (answer) $("advice").dataset.body = key;
    $("advice").dataset.status = answer ? "ready" : "error";
    markAdviceStale(Boolean(state.adviseWanted)); // newer inputs already wait for their own search
  }

  // What the advisor was asked: the page's constant rate, or the autoscaling panel's schedule and autoscaler.
  function renderAdviceScope() {
    const scope = $("advice-scope");
    const fields = state.adviceBody && state.adviceBody.autoscale ? state.adviceBody : null;
    scope.hidden = !fields;
    if (!fields) return;
    $("advice-scope-text").textContent = t("advice.autoscaled", {
      schedule: window.LabAutoscale.scheduleLabel(fields.rate_schedule), policy: t(`as.policy_${fields.autoscale}`),
      max: fields.max_replicas, startup: num(fields.startup_s), cooldown: num(fields.cooldown_s) });
    $("advice-scope-cli").textContent = `servelab lab advise --rate-schedule ${fields.rate_schedule} ` +
      `--autoscale ${fields.autoscale} --min-replicas ${fields.min_replicas} --max-replicas ${fields.max_replicas} ` +
      `--startup-time ${fields.startup_s} --cooldown ${fields.cooldown_s} --scale-interval ${fields.interval_s}`;
  }

  function gpuName(id) {
    const gpu = state.catalog.gpus.find((g) => g.id === id);
    return gpu ? gpu.name : id;
  }

  function shapeText(d) {
    const shape = d.disaggregate ? t("fmt.split_instances", { p: d.disaggregate.split(":")[0], d: d.disaggregate.split(":")[1] })
      : tn("fmt.replicas", d.num_instances);
    return t("advice.shape", { n: d.num_gpus, gpu: gpuName(d.gpu), tp: d.tp, shape });
  }

  function renderAdvice() {
    const status = $("advice-status");
    const holder = $("recommendation");
    const list = $("decisions");
    holder.replaceChildren();
    list.replaceChildren();
    renderAdviceScope();
    // a language switch while the advisor runs leaves its (translated) status until it answers
    const setStatus = (text) => { if (!state.advising) { status.className = "run-status"; status.textContent = text; } };
    setStatus("");
    if (state.adviceError) {
      holder.textContent = t("advice.failed", { message: state.adviceError });
      return;
    }
    const advice = state.advice;
    if (!advice) return;
    const shapes = tn("fmt.shapes", advice.candidates.length);
    setStatus(t("advice.simulated", { shapes }));
    const rec = advice.recommendation;
    if (!rec) {
      holder.textContent = t("advice.none", { max: advice.max_gpus, shapes });
    } else {
      const x = rec.metrics;
      holder.innerHTML = `<div class="shape"></div><div class="rec-metrics"></div>`;
      holder.querySelector(".shape").textContent = shapeText(rec.deployment);
      holder.querySelector(".rec-metrics").textContent = t("advice.metrics", { ttft: ms(x.p99_ttft_ms),
        tpot: ms(x.p99_tpot_ms), tps: num(x.output_throughput), shapes });
      const apply = document.createElement("button");
      apply.type = "button";
      apply.id = "apply-recommendation";
      apply.textContent = t("advice.apply");
      apply.addEventListener("click", () => {
        setInputs({ ...buildBody(), ...rec.deployment, schedule: "continuous", max_num_seqs: rec.deployment.max_num_seqs });
        scheduleRun(0);
      });
      holder.appendChild(apply);
    }
    for (const d of advice.decisions) {
      const li = document.createElement("li");
      li.innerHTML = `<span class="decision"></span><span class="pill ${d.taken ? "taken" : "not-taken"}"></span>` +
        `<span class="why"></span>`;
      li.dataset.decision = d.decision;
      li.querySelector(".decision").textContent = window.LabPhrases.decision(d.decision);
      li.querySelector(".pill").textContent = t(d.taken ? "advice.taken" : "advice.not_taken");
      li.querySelector(".why").textContent = window.LabPhrases.why(d.why);
      list.appendChild(li);
    }
  }

  // ---- the live engine (only when `servelab serve` serves this page)
  // The diagram takes the running server's shape (-tp, --disaggregate, engine cores) so that its boxes are the
  // processes the live panel lists; the workload inputs stay as they are.
  function drawThisServer() {
    const shape = window.LabLayout.shape();
    if (!shape) return;
    state.liveShape = shape;
    setInputs({ ...buildBody(), tp: shape.tp, num_gpus: shape.engines * shape.tp, schedule: "continuous",
      disaggregate: shape.disaggregate });
    scheduleRun(0);
  }

  function renderLiveNote(body) {
    const note = $("diagram-live-note");
    const s = state.liveShape;
    const matches = Boolean(s) && body.tp === s.tp && body.num_gpus === s.engines * s.tp
      && (body.disaggregate ?? null) === s.disaggregate;
    note.hidden = !matches;
    $("architecture").dataset.live = String(matches);
    if (matches) {
      note.textContent = s.disaggregate
        ? t("arch.live_note_pd", { split: s.disaggregate, tp: s.tp })
        : t("arch.live_note", { engines: tn("fmt.engine_cores", s.engines), tp: s.tp });
    }
  }

  function startLive(info) {
    $("live").hidden = false;
    if (info.layout) {
      window.LabLayout.start(info.layout);
      const draw = $("diagram-live");
      draw.hidden = false;
      draw.addEventListener("click", drawThisServer);
    }
    const badge = $("engine-badge");
    badge.dataset.i18n = "badge.live";
    badge.textContent = t("badge.live");
    badge.classList.add("live");
    if (info.needs_api_key) {
      startLiveNote(info);
      return;
    }
    const status = $("live-status");
    const source = new EventSource(info.metrics_stream);
    source.onopen = () => { status.textContent = t("live.connected"); };
    source.onerror = () => { status.textContent = t("live.reconnecting"); };
    source.onmessage = (event) => {
      const s = JSON.parse(event.data);
      status.textContent = t("live.connected");
      const kv = s.kv_cache_usage_perc;
      $("live-kv").textContent = kv == null ? "–" : pct(kv);
      $("live-kv-bar").style.width = `${(kv || 0) * 100}%`;
      $("live-reqs").textContent = s.num_requests_running == null ? "–"
        : `${s.num_requests_running} / ${s.num_requests_waiting}`;
      $("live-slots-bar").style.width = `${Math.min(1, s.batch_slot_saturation || 0) * 100}%`;
      $("live-tps").textContent = num(s.generation_tokens_per_s || 0, 1);
      const recent = s.recent || {};
      $("live-ttft").textContent = recent.completed ? ms(recent.median_ttft_ms) : "–";
      const blocks = s.kv_cache_num_blocks == null ? "" : t("live.blocks", { n: num(s.kv_cache_num_blocks) });
      $("live-note").textContent = t("live.note", { model: s.model, weights: memory(s.weight_bytes), blocks,
        served: num(s.requests_finished_total || 0), max: s.max_num_seqs ?? "–" });
      $("live").dataset.updates = String(Number($("live").dataset.updates || 0) + 1);
    };
  }

  // ---- start
  function fillSelects() {
    const model = $("in-model");
    const gpu = $("in-gpu");
    const tpot = $("in-tpot");
    const keep = [model.value, gpu.value, tpot.value];
    model.replaceChildren();
    gpu.replaceChildren();
    tpot.replaceChildren();
    for (const m of state.catalog.models) {
      model.add(new Option(t("in.model_option", { name: m.name, gib: num(m.weight_gib_bf16) }), m.id));
    }
    for (const g of state.catalog.gpus) {
      gpu.add(new Option(`${g.name} · ${num(g.memory_gib)} GiB · ${num(g.memory_bandwidth_gb_s / 1000, 1)} TB/s`, g.id));
    }
    for (const x of TPOT_TARGETS) tpot.add(new Option(x == null ? t("in.tpot_none") : `${x} ms`, x == null ? "" : String(x)));
    if (keep[0]) [model.value, gpu.value, tpot.value] = keep;
    $("in-prompts").max = String(state.catalog.limits.num_prompts);
  }

  function wire() {
    const controls = document.querySelectorAll(".inputs input, .inputs select");
    controls.forEach((el) => el.addEventListener("input", () => {
      if (el.id === "sw-pd" && el.checked) $("sw-continuous").checked = true;
      if (el.id === "sw-continuous" && !el.checked) $("sw-pd").checked = false;
      syncControls(el.id === "in-gpus" ? Number(el.value) : undefined);
      const body = buildBody();
      renderDiagram(body, null);
      renderStageCards(body);
      scheduleRun();
    }));
  }

  // A language switch redraws every string from the answers already in hand; an error message comes from the
  // server, so the run that failed is asked again in the new language.
  function relabel() {
    fillSelects();
    updateLabels();
    labelPresets();
    if (state.last) {
      render(state.last.body, state.last.result);
      $("run-status").textContent = t("status.simulated", { s: num(state.last.seconds, 2) });
    } else {
      renderDiagram(buildBody(), null);
    }
    window.LabWalkthrough.render(state.walkView);
    renderAdvice();
    if (state.catalog.live_engine && state.catalog.live_engine.needs_api_key) startLiveNote(state.catalog.live_engine);
    if (state.error) scheduleRun(0);
  }

  function startLiveNote(info) {
    $("live-note").textContent = t("live.needs_key", { url: info.metrics_stream });
  }

  async function init() {
    try {
      await window.LabI18n.ready;
    } catch (err) {
      showError(`servelab lab: ${err.message}`);
      return;
    }
    try {
      const response = await fetch("/lab/api/catalog");
      state.catalog = await response.json();
    } catch (err) {
      showError(t("error.catalog", { message: err.message }));
      return;
    }
    fillSelects();
    buildDiagram();
    buildMeters();
    buildStageCards();
    wire();
    window.LabWalkthrough.render(null);
    const linked = Number(new URLSearchParams(location.search).get("stage"));
    const preset = state.catalog.presets.find((p) => p.stage === linked);
    setInputs(preset ? preset.inputs : state.catalog.defaults);
    const body = buildBody();
    renderDiagram(body, null);
    renderStageCards(body);
    if (state.catalog.live_engine) startLive(state.catalog.live_engine);
    window.LabI18n.onChange(relabel);
    scheduleRun(0);
  }

  // The current inputs, for the autoscaling panel (autoscale.js), which asks the advisor again (`readvise`) when
  // its settings change what the advisor is asked.
  window.LabPage = { body: buildBody, readvise: () => scheduleRun(0) };
  init();
})();
