// The servelab lab page: inputs -> POST /lab/api/simulate (and /advise) -> diagram, meters, decisions.
// Plain JS, no build step, no network beyond this server.
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
  const DEBOUNCE_MS = 250;
  const ADVISE_SETTLE_MS = 500;
  const MAX_BUSY_RETRIES = 120;
  const STAGE_NAMES = {
    1: "one request at a time",
    2: "static batching with a KV cache",
    3: "continuous batching + paged attention",
    4: "tensor-parallel sharding",
    5: "prefill/decode disaggregation",
  };
  const DEPLOYMENT_FIELDS = ["num_gpus", "tp", "schedule", "disaggregate"];

  const $ = (id) => document.getElementById(id);
  const state = {
    catalog: null, pending: false, inFlight: false, advising: false, debounce: null, adviseKey: null,
    simulations: 0,
  };

  // ---- formatting
  const num = (x, digits = 0) => Number(x).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
  const pct = (x) => `${num(x * 100, x > 0 && x < 0.1 ? 1 : 0)}%`;
  const gib = (bytes) => num(bytes / 2 ** 30, 1);
  const memory = (bytes) => (bytes >= 2 ** 30 ? `${gib(bytes)} GiB` : `${num(bytes / 2 ** 20, 1)} MiB`);
  const ms = (x) => {
    if (x == null) return "–";
    if (x >= 10000) return `${num(x / 1000, 0)} s`;
    if (x >= 1000) return `${num(x / 1000, 1)} s`;
    return `${num(x, x < 10 ? 1 : 0)} ms`;
  };
  const rateLabel = (r) => (r === "inf" ? "all at once" : `${num(r, 2)} req/s`);
  const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;

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
    const sharegpt = $("in-dataset").value === "sharegpt-like";
    const tpot = $("in-tpot").value;
    return {
      model: $("in-model").value,
      gpu: $("in-gpu").value,
      num_gpus: Number($("in-gpus").value),
      tp,
      schedule: continuous ? "continuous" : (slots === 1 ? "serial" : "static"),
      disaggregate: split ? `${split[0]}:${split[1]}` : null,
      max_num_seqs: slots,
      request_rate: sliders.rate.get(),
      num_prompts: intOf("in-prompts", 400),
      input_len: sharegpt ? null : sliders.inputLen.get(),
      output_len: sharegpt ? null : sliders.outputLen.get(),
      range_ratio: Number($("in-range").value) || 0,
      dataset: $("in-dataset").value,
      burstiness: Number($("in-burst").value) || 1,
      seed: intOf("in-seed", 0),
      ttft_target_ms: sliders.ttft.get(),
      tpot_target_ms: tpot === "" ? null : Number(tpot),
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
    $("in-range").value = String(inputs.range_ratio);
    $("in-burst").value = String(inputs.burstiness);
    $("in-prompts").value = String(inputs.num_prompts);
    $("in-seed").value = String(inputs.seed);
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
    const sharegpt = $("in-dataset").value === "sharegpt-like";
    sliders.inputLen.el.disabled = sharegpt;
    sliders.outputLen.el.disabled = sharegpt;
    updateLabels();
  }

  function updateLabels() {
    const body = buildBody();
    $("out-rate").textContent = rateLabel(body.request_rate);
    $("out-input-len").textContent = body.input_len == null ? "sharegpt-like" : `${num(body.input_len)} tokens`;
    $("out-output-len").textContent = body.output_len == null ? "sharegpt-like" : `${num(body.output_len)} tokens`;
    $("out-ttft").textContent = ms(body.ttft_target_ms);
    $("out-slots").textContent = String(body.max_num_seqs);
    const instances = body.num_gpus / body.tp;
    let shape = `${plural(instances, "replica")}`;
    if (body.disaggregate) shape = `${body.disaggregate.replace(":", " prefill : ")} decode`;
    $("out-gpus").textContent = `${body.num_gpus} (${shape}${body.tp > 1 ? `, TP ${body.tp}` : ""})`;
    const notes = {
      serial: "Switch off, 1 slot: serial, one request at a time.",
      static: `Switch off: static batches of up to ${body.max_num_seqs}, contiguous KV per request.`,
      continuous: `Up to ${body.max_num_seqs} requests join and leave every step; KV in 16-token blocks.`,
    };
    $("schedule-note").textContent = notes[body.schedule];
    $("cli-command").textContent = cliCommand(body);
  }

  function cliCommand(b) {
    const parts = ["servelab lab simulate", `--model ${b.model}`, `--gpu ${b.gpu}`, `--num-gpus ${b.num_gpus}`,
      `--tp ${b.tp}`, `--schedule ${b.schedule}`];
    if (b.disaggregate) parts.push(`--disaggregate ${b.disaggregate}`);
    parts.push(`--max-num-seqs ${b.max_num_seqs}`, `--dataset ${b.dataset}`);
    if (b.input_len != null) parts.push(`--input-len ${b.input_len}`);
    if (b.output_len != null) parts.push(`--output-len ${b.output_len}`);
    parts.push(`--range-ratio ${b.range_ratio}`, `--request-rate ${b.request_rate}`, `--burstiness ${b.burstiness}`,
      `--num-prompts ${b.num_prompts}`, `--seed ${b.seed}`, `--ttft-target ${b.ttft_target_ms}ms`);
    if (b.tpot_target_ms != null) parts.push(`--tpot-target ${b.tpot_target_ms}ms`);
    parts.push("--json");
    return parts.join(" ");
  }

  function stageOf(body) {
    if (body.disaggregate) return 5;
    if (body.tp > 1) return 4;
    return { continuous: 3, static: 2, serial: 1 }[body.schedule];
  }

  function sameInputs(a, b) {
    return Object.keys(b).every((k) => JSON.stringify(a[k] ?? null) === JSON.stringify(b[k] ?? null));
  }

  // ---- running simulations: one request in flight; newer inputs wait for it, then run once
  function scheduleRun(delay = DEBOUNCE_MS) {
    clearTimeout(state.debounce);
    $("meters").dataset.status = "pending";
    if (state.advising) $("run-status").textContent = "queued: the advisor is still simulating shapes";
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
        if (state.pending) continue;
        const adviseBody = adviseBodyOf(body);
        const key = JSON.stringify(adviseBody);
        if (key === state.adviseKey) continue;
        markAdviceStale(true);
        await sleep(ADVISE_SETTLE_MS);
        if (state.pending) continue;
        await advise(adviseBody, key);
      }
    } finally {
      state.inFlight = false;
    }
  }

  const sleep = (t) => new Promise((resolve) => setTimeout(resolve, t));

  async function callLab(command, body, statusEl) {
    for (let attempt = 0; attempt <= MAX_BUSY_RETRIES; attempt++) {
      const response = await fetch(`/lab/api/${command}`, {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
      });
      if (response.status === 429) {
        statusEl.textContent = "waiting: another simulation is running";
        await sleep(1000 * Number(response.headers.get("Retry-After") || 1));
        continue;
      }
      const payload = await response.json();
      if (!response.ok) {
        const error = payload.error || {};
        throw new Error(`${error.message || response.statusText}${error.param ? ` (field: ${error.param})` : ""}`);
      }
      return payload;
    }
    throw new Error("the lab stayed busy; try again in a moment");
  }

  async function simulate(body) {
    const status = $("run-status");
    status.className = "run-status busy";
    status.textContent = "simulating";
    $("meters").dataset.status = "busy";
    const started = performance.now();
    try {
      const result = await callLab("simulate", body, status);
      hideError();
      render(body, result);
      status.className = "run-status";
      status.textContent = `simulated in ${num((performance.now() - started) / 1000, 2)} s`;
      $("meters").dataset.body = JSON.stringify(body);
      $("meters").dataset.runs = String(++state.simulations);
      $("meters").dataset.status = "ready";
    } catch (err) {
      showError(`Simulation not run: ${err.message}`);
      status.className = "run-status";
      status.textContent = "";
      $("meters").dataset.status = "error";
    }
  }

  function showError(message) {
    const banner = $("error-banner");
    banner.textContent = message;
    banner.hidden = false;
  }

  function hideError() {
    $("error-banner").hidden = true;
  }

  // ---- meters
  const METERS = [
    ["kv", "KV-cache pressure"], ["weights", "Weights per GPU"], ["decode", "Decode throughput vs capacity"],
    ["slots", "Batch-slot saturation"], ["ttft", "Time to first token (p50 / p99)"], ["tpot", "Time per output token"],
    ["goodput", "Goodput"], ["queue", "Queueing"], ["step", "Step time"], ["transfer", "KV handoff (prefill → decode)"],
  ];

  function buildMeters() {
    const list = $("meter-list");
    for (const [id, name] of METERS) {
      const el = document.createElement("div");
      el.className = "meter";
      el.id = `meter-${id}`;
      el.innerHTML = `<div class="meter-head"><span class="meter-name">${name}</span><span class="badge">bottleneck</span></div>
        <div class="bar"><div class="fill"></div></div><div class="meter-value">–</div>`;
      list.appendChild(el);
    }
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
    let text = `p50 ${ms(meter.median_ms)} · p99 ${ms(meter.p99_ms)}`;
    text += meter.target_ms ? ` · target ${ms(meter.target_ms)}` : " · no target";
    if (meter.attainment != null) text += ` (${pct(meter.attainment)} of requests within it)`;
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
        text: `${gib(w.bytes_per_gpu)} GiB per GPU (TP ${body.tp}) vs ${gib(w.usable_bytes)} GiB usable of ` +
          `${gib(w.memory_bytes)} GiB; activations ${gib(w.activation_bytes)} GiB; KV left ${gib(w.kv_cache_bytes_per_gpu)} GiB ` +
          `= ${num(w.kv_cache_tokens)} tokens for requests of up to ${num(w.max_request_tokens)}`,
      });
      for (const [id] of METERS) {
        if (id !== "weights") setMeter(id, { na: true, text: "– (not simulated: the deployment does not fit)", hidden: id === "transfer" });
      }
      return;
    }
    const kv = m.kv_cache;
    let kvText = `peak ${pct(kv.peak_usage)} · mean ${pct(kv.mean_usage)} of ${num(kv.num_blocks)} blocks ` +
      `(${num(kv.num_blocks * kv.block_size)} tokens)`;
    if (kv.reserved_unused_share != null) kvText += ` · ${pct(kv.reserved_unused_share)} reserved but unused`;
    kvText += ` · ${plural(kv.num_preemptions, "preemption")}`;
    setMeter("kv", { value: kv.peak_usage, fill: kv.peak_usage, marks: [[0.9, "target"]], text: kvText, bottleneck: kv.bottleneck });

    const w = m.weights;
    let wText = `${gib(w.bytes_per_gpu)} GiB of ${gib(w.bytes_per_gpu / w.share_of_memory)} GiB (${pct(w.share_of_memory)})`;
    if (body.tp > 1) wText += ` · whole model ${gib(w.bytes_per_gpu * body.tp)} GiB over TP ${body.tp}`;
    wText += ` · KV pool ${gib(w.kv_cache_bytes_per_gpu)} GiB`;
    setMeter("weights", { value: w.bytes_per_gpu, fill: w.share_of_memory, marks: [[0.75, "target"]], text: wText, bottleneck: w.bottleneck });

    const d = m.decode_throughput;
    const demanded = d.demanded_tokens_per_s != null;
    setMeter("decode", {
      value: d.utilization, fill: Math.min(d.utilization, 1.0001), marks: [[0.9, "target"]], bottleneck: d.bottleneck,
      text: `${num(demanded ? d.demanded_tokens_per_s : d.served_tokens_per_s)} tok/s ${demanded ? "demanded" : "served"} of ` +
        `${num(d.capacity_tokens_per_s)} capacity (${pct(d.utilization)})`,
    });

    const s = m.batch_slots;
    setMeter("slots", {
      value: s.mean_saturation, fill: s.mean_saturation, bottleneck: s.bottleneck,
      text: `mean ${num(s.mean_running, 1)} · peak ${num(s.peak_running)} of ${num(s.max_num_seqs)} slots; all full with ` +
        `requests waiting ${pct(s.full_with_waiting_share)} of the time`,
    });

    setMeter("ttft", latencySpec(m.ttft, "ttft"));
    setMeter("tpot", latencySpec(m.tpot, "tpot"));

    const g = m.goodput;
    const hasTargets = body.ttft_target_ms != null || body.tpot_target_ms != null;
    setMeter("goodput", {
      value: g.slo_attainment, fill: g.slo_attainment, marks: [[0.99, "target"]], bottleneck: g.bottleneck,
      text: hasTargets ? `${num(g.requests_per_s, 2)} req/s meet every target (${pct(g.slo_attainment)} of requests)`
        : `${num(g.requests_per_s, 2)} req/s (no targets set)`,
    });

    const q = m.queue;
    setMeter("queue", {
      value: q.mean_queue_ms, fill: q.share_of_ttft, marks: [[0.5, "target"]], bottleneck: q.bottleneck,
      text: `mean wait ${ms(q.mean_queue_ms)} = ${pct(q.share_of_ttft)} of TTFT · peak ${plural(q.peak_waiting, "request")} waiting`,
    });

    const st = m.step_time;
    const parts = ["weights", "attention", "communication", "overhead"];
    setMeter("step", {
      value: st.mean_step_ms, bottleneck: st.bottleneck,
      segments: parts.map((k) => [st[`${k}_share`] || 0, STEP_COLORS[k]]),
      text: `${num(st.mean_step_ms, 2)} ms per step: weights ${pct(st.weights_share || 0)}, attention ` +
        `${pct(st.attention_share || 0)}, all-reduce ${pct(st.communication_share || 0)}, overhead ${pct(st.overhead_share || 0)}`,
    });

    const t = m.kv_transfer;
    setMeter("transfer", t ? {
      value: t.mean_ms, fill: t.share_of_ttft, marks: [[0.5, "target"]], bottleneck: t.bottleneck,
      text: `mean ${ms(t.mean_ms)} · p99 ${ms(t.p99_ms)} = ${pct(t.share_of_ttft)} of TTFT`,
    } : { hidden: true, text: "" });
  }

  const BOTTLENECK_NAMES = {
    kv_cache: "KV-cache pressure", weights: "weights per GPU", decode_throughput: "decode capacity",
    batch_slots: "batch slots", ttft: "TTFT over its target", tpot: "TPOT over its target", goodput: "goodput",
    preemptions: "preemptions", queue: "queueing", step_time: "all-reduce time", kv_transfer: "KV handoff",
  };

  function render(body, r) {
    renderMeters(body, r);
    const line = $("bottleneck-line");
    const notFit = $("does-not-fit");
    if (!r.fits) {
      notFit.hidden = false;
      notFit.innerHTML = "<strong>Does not fit</strong>";
      notFit.appendChild(document.createTextNode(r.reason));
      line.className = "bottleneck-line flagged";
      line.textContent = "Bottleneck: memory. Shard the model (tensor parallelism) or pick a GPU with more memory.";
      $("summary-line").textContent = "";
    } else {
      notFit.hidden = true;
      const flagged = Object.entries(r.meters).filter(([, v]) => v && v.bottleneck).map(([k]) => BOTTLENECK_NAMES[k] || k);
      line.className = `bottleneck-line ${flagged.length ? "flagged" : "clear"}`;
      line.textContent = flagged.length ? `Bottleneck: ${flagged.join(", ")}` : "No bottleneck: every meter is inside its limit.";
      const x = r.metrics;
      $("summary-line").textContent = `${num(x.output_throughput)} output tok/s · ${num(x.request_throughput, 2)} req/s completed · ` +
        `E2E p50 ${ms(x.median_e2el_ms)} · ${num(x.completed)} requests over ${num(x.duration, 1)} s of simulated time`;
    }
    renderDiagram(body, r);
    renderStageCards(body);
  }

  // ---- the diagram: [id, title, x, y, width] of each box, 58 high
  const SVG_NS = "http://www.w3.org/2000/svg";
  const BOXES = [
    ["clients", "Clients", 10, 112, 130], ["gateway", "Gateway", 166, 112, 130],
    ["scheduler", "Scheduler", 322, 112, 140], ["prefill", "Prefill pool", 496, 18, 150],
    ["workers", "GPU workers", 496, 112, 150], ["kv", "Paged KV cache", 676, 112, 160],
    ["shards", "Model shards", 496, 206, 150], ["metrics", "Metrics stream", 322, 230, 140],
  ];

  function buildDiagram() {
    const holder = $("boxes");
    for (const [id, title, x, y, width] of BOXES) {
      const box = document.createElementNS(SVG_NS, "g");
      box.id = `box-${id}`;
      box.setAttribute("class", "box");
      box.setAttribute("transform", `translate(${x},${y})`);
      const rect = document.createElementNS(SVG_NS, "rect");
      for (const [k, v] of Object.entries({ width, height: 58, rx: 10 })) rect.setAttribute(k, String(v));
      box.appendChild(rect);
      for (const [cls, line, text] of [["box-title", 24, title], ["box-sub", 44, ""]]) {
        const node = document.createElementNS(SVG_NS, "text");
        node.id = `${cls === "box-title" ? "title" : "sub"}-${id}`;
        node.setAttribute("class", cls);
        node.setAttribute("x", String(width / 2));
        node.setAttribute("y", String(line));
        node.textContent = text;
        box.appendChild(node);
      }
      holder.appendChild(box);
    }
  }

  function setBox(id, on, isNew, sub, bottleneck = false) {
    const box = $(`box-${id}`);
    box.classList.toggle("on", on);
    box.classList.toggle("off", !on);
    box.classList.toggle("new", on && isNew);
    box.classList.toggle("bottleneck", bottleneck);
    box.dataset.state = on ? "active" : "idle";
    if (sub != null) $(`sub-${id}`).textContent = sub;
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
    $("stage-label").textContent = `Stage ${stage} · ${STAGE_NAMES[stage]}`;
    $("architecture").dataset.stage = String(stage);

    setBox("clients", true, false, rateLabel(body.request_rate));
    setBox("gateway", true, false, "admits + streams");
    const schedulerSub = { serial: "one at a time", static: `static batches of ${body.max_num_seqs}`,
      continuous: `continuous, ${body.max_num_seqs} slots` }[body.schedule];
    setBox("scheduler", true, stage <= 3, schedulerSub, Boolean(m && (m.batch_slots.bottleneck || m.queue.bottleneck)));
    setBox("prefill", Boolean(split), stage === 5,
      split ? `${plural(split[0], "instance")} × TP ${body.tp}` : "off (mixed into steps)");
    const workerSub = split ? `${plural(split[1], "decode instance")}` : `${plural(instances, "replica")} × ${plural(body.tp, "GPU")}`;
    const weightsFlag = Boolean(r && (!r.fits || r.meters.weights.bottleneck));
    setBox("workers", true, false, workerSub, Boolean((m && m.decode_throughput.bottleneck) || (weightsFlag && body.tp === 1)));
    $("title-kv").textContent = paged ? "Paged KV cache" : "KV cache";
    let kvSub = paged ? "blocks of 16" : (body.schedule === "serial" ? "one reservation" : "contiguous");
    if (m) kvSub += ` · peak ${pct(m.kv_cache.peak_usage)}`;
    setBox("kv", true, stage === 2 || stage === 3, kvSub, Boolean(m && m.kv_cache.bottleneck));
    setBox("shards", body.tp > 1, stage === 4,
      body.tp > 1 ? `TP ${body.tp}${weights ? `: ${gib(weights.bytes_per_gpu)} GiB/GPU` : ""}` : "off: whole model/GPU",
      weightsFlag && body.tp > 1);
    setBox("metrics", true, false, "async, off hot path");
    setLink("link-scheduler-prefill", Boolean(split));
    setLink("link-prefill-workers", Boolean(split));
    setLink("link-workers-shards", body.tp > 1);
    $("label-handoff").classList.toggle("off", !split);
  }

  // ---- evolution cards
  function buildStageCards() {
    const holder = $("stage-cards");
    for (const preset of state.catalog.presets) {
      const card = document.createElement("button");
      card.type = "button";
      card.className = "stage-card";
      card.id = `stage-card-${preset.stage}`;
      card.dataset.stage = String(preset.stage);
      card.innerHTML = `<span class="num">${preset.stage}</span><span class="title"></span><p class="summary"></p><p class="watch"></p>`;
      card.querySelector(".title").textContent = preset.title;
      card.querySelector(".summary").textContent = preset.summary;
      card.querySelector(".watch").textContent = `Watch: ${preset.watch}`;
      card.addEventListener("click", () => {
        setInputs(preset.inputs);
        renderStageCards(buildBody());
        renderDiagram(buildBody(), null);
        scheduleRun(0);
      });
      holder.appendChild(card);
    }
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
    return out;
  }

  function markAdviceStale(stale) {
    $("recommendation").classList.toggle("stale", stale);
    $("decisions").classList.toggle("stale", stale);
  }

  async function advise(body, key) {
    const status = $("advice-status");
    status.className = "run-status busy";
    status.textContent = "simulating candidate shapes";
    $("advice").dataset.status = "busy";
    state.advising = true;
    try {
      const advice = await callLab("advise", body, status);
      state.adviseKey = key;
      renderAdvice(advice);
      status.className = "run-status";
      status.textContent = `${plural(advice.candidates.length, "shape")} simulated`;
      $("advice").dataset.status = "ready";
    } catch (err) {
      status.className = "run-status";
      status.textContent = "";
      $("recommendation").textContent = `The advisor did not run: ${err.message}`;
      $("decisions").replaceChildren();
      $("advice").dataset.status = "error";
    } finally {
      state.advising = false;
    }
    markAdviceStale(false);
  }

  function gpuName(id) {
    const gpu = state.catalog.gpus.find((g) => g.id === id);
    return gpu ? gpu.name : id;
  }

  function shapeText(d) {
    const shape = d.disaggregate ? `${d.disaggregate.replace(":", " prefill + ")} decode instances` : plural(d.num_instances, "replica");
    return `${d.num_gpus}× ${gpuName(d.gpu)}, TP ${d.tp}, ${shape}`;
  }

  function renderAdvice(advice) {
    const holder = $("recommendation");
    holder.replaceChildren();
    const rec = advice.recommendation;
    if (!rec) {
      holder.textContent = `No shape of up to ${advice.max_gpus} GPUs meets these targets ` +
        `(${plural(advice.candidates.length, "shape")} simulated). Loosen the targets, or pick a larger GPU.`;
    } else {
      const x = rec.metrics;
      holder.innerHTML = `<div class="shape"></div><div class="rec-metrics"></div>`;
      holder.querySelector(".shape").textContent = shapeText(rec.deployment);
      holder.querySelector(".rec-metrics").textContent = `p99 TTFT ${ms(x.p99_ttft_ms)} · p99 TPOT ${ms(x.p99_tpot_ms)} · ` +
        `${num(x.output_throughput)} output tok/s · ${plural(advice.candidates.length, "shape")} simulated`;
      const apply = document.createElement("button");
      apply.type = "button";
      apply.id = "apply-recommendation";
      apply.textContent = "Use this shape";
      apply.addEventListener("click", () => {
        setInputs({ ...buildBody(), ...rec.deployment, schedule: "continuous", max_num_seqs: rec.deployment.max_num_seqs });
        scheduleRun(0);
      });
      holder.appendChild(apply);
    }
    const list = $("decisions");
    list.replaceChildren();
    for (const d of advice.decisions) {
      const li = document.createElement("li");
      li.innerHTML = `<span class="decision"></span><span class="pill ${d.taken ? "taken" : "not-taken"}">` +
        `${d.taken ? "taken" : "not taken"}</span><span class="why"></span>`;
      li.querySelector(".decision").textContent = d.decision;
      li.querySelector(".why").textContent = d.why;
      list.appendChild(li);
    }
  }

  // ---- the live engine (only when `servelab serve` serves this page)
  function startLive(info) {
    $("live").hidden = false;
    const badge = $("engine-badge");
    badge.textContent = "live engine + simulator";
    badge.classList.add("live");
    if (info.needs_api_key) {
      $("live-note").textContent = "This server protects its metrics (--protect-metrics) and a browser stream cannot send " +
        "the API key; read them with curl -N -H 'Authorization: Bearer KEY' " + info.metrics_stream;
      return;
    }
    const status = $("live-status");
    const source = new EventSource(info.metrics_stream);
    source.onopen = () => { status.textContent = "connected"; };
    source.onerror = () => { status.textContent = "reconnecting"; };
    source.onmessage = (event) => {
      const s = JSON.parse(event.data);
      status.textContent = "connected";
      const kv = s.kv_cache_usage_perc;
      $("live-kv").textContent = kv == null ? "–" : pct(kv);
      $("live-kv-bar").style.width = `${(kv || 0) * 100}%`;
      $("live-reqs").textContent = s.num_requests_running == null ? "–"
        : `${s.num_requests_running} / ${s.num_requests_waiting}`;
      $("live-slots-bar").style.width = `${Math.min(1, s.batch_slot_saturation || 0) * 100}%`;
      $("live-tps").textContent = num(s.generation_tokens_per_s || 0, 1);
      const recent = s.recent || {};
      $("live-ttft").textContent = recent.completed ? ms(recent.median_ttft_ms) : "–";
      const blocks = s.kv_cache_num_blocks == null ? "" : ` · ${num(s.kv_cache_num_blocks)} KV blocks`;
      $("live-note").textContent = `${s.model} · ${memory(s.weight_bytes)} of weights${blocks} · ` +
        `${num(s.requests_finished_total || 0)} requests served · max ${s.max_num_seqs ?? "–"} running`;
      $("live").dataset.updates = String(Number($("live").dataset.updates || 0) + 1);
    };
  }

  // ---- start
  function fillSelects() {
    const model = $("in-model");
    for (const m of state.catalog.models) {
      model.add(new Option(`${m.name} (${num(m.weight_gib_bf16)} GiB in bf16)`, m.id));
    }
    const gpu = $("in-gpu");
    for (const g of state.catalog.gpus) {
      gpu.add(new Option(`${g.name} · ${num(g.memory_gib)} GiB · ${num(g.memory_bandwidth_gb_s / 1000, 1)} TB/s`, g.id));
    }
    const tpot = $("in-tpot");
    for (const t of TPOT_TARGETS) tpot.add(new Option(t == null ? "none" : `${t} ms`, t == null ? "" : String(t)));
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
    const notes = document.querySelectorAll("#diagram-notes li");
    ["clients", "gateway", "scheduler", "prefill", "workers", "kv", "shards", "metrics"].forEach((id, i) => {
      notes[i].dataset.box = id;
    });
  }

  async function init() {
    try {
      const response = await fetch("/lab/api/catalog");
      state.catalog = await response.json();
    } catch (err) {
      showError(`Cannot load the lab catalog: ${err.message}`);
      return;
    }
    fillSelects();
    buildDiagram();
    buildMeters();
    buildStageCards();
    wire();
    setInputs(state.catalog.defaults);
    const body = buildBody();
    renderDiagram(body, null);
    renderStageCards(body);
    if (state.catalog.live_engine) startLive(state.catalog.live_engine);
    scheduleRun(0);
  }

  init();
})();
