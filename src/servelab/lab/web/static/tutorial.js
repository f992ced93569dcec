// The tutorial's figures: each stage card's preset simulated through /lab/api/simulate when the page loads, and
// the real engine's runs from measured/stages.json (`servelab bench stages`), matched to a stage by the number
// that starts the run's name ("3 continuous + paged ..."). A stage with no such run says it is not measured yet.
"use strict";

(() => {
  const { t, fmt } = window.LabI18n;
  const { num, pct, gib, ms } = fmt;
  const MAX_BUSY_RETRIES = 120;
  const tps = (x) => t("fmt.tok_s", { n: num(x) });
  const rps = (x) => t("fmt.req_s", { n: num(x, 2) });
  // [row id, label key, value of a simulate answer, format]
  const SIM_ROWS = [
    ["median_ttft_ms", "tut.row.ttft_p50", (r) => r.metrics.median_ttft_ms, ms],
    ["p99_ttft_ms", "tut.row.ttft_p99", (r) => r.metrics.p99_ttft_ms, ms],
    ["p99_tpot_ms", "tut.row.tpot_p99", (r) => r.metrics.p99_tpot_ms, ms],
    ["output_throughput", "tut.row.throughput", (r) => r.metrics.output_throughput, tps],
    ["kv_peak_usage", "tut.row.kv", (r) => r.meters.kv_cache.peak_usage, pct],
    ["weights_bytes_per_gpu", "tut.row.weights", (r) => r.meters.weights.bytes_per_gpu, (b) => `${gib(b)} GiB`],
    ["decode_utilization", "tut.row.decode", (r) => r.meters.decode_throughput.utilization, pct],
  ];
  // [field of a measured run, label key, format]
  const MEASURED_ROWS = [
    ["median_ttft_ms", "tut.row.ttft_p50", ms], ["p99_ttft_ms", "tut.row.ttft_p99", ms],
    ["median_tpot_ms", "tut.row.tpot_p50", ms], ["p99_tpot_ms", "tut.row.tpot_p99", ms],
    ["output_throughput", "tut.row.throughput", tps], ["request_throughput", "tut.row.requests", rps],
    ["max_concurrent_requests", "tut.row.concurrency", num], ["num_preemptions", "tut.row.preemptions", num],
  ];
  // sims: each preset's answer; baselines: a prefix-routed preset's inputs with the least-loaded router
  const state = { catalog: null, sims: {}, simErrors: {}, baselines: {}, measured: null, measuredError: null };
  const $ = (id) => document.getElementById(id);

  const simulate = (inputs) => window.LabI18n.post("/lab/api/simulate", inputs, () => {}, MAX_BUSY_RETRIES);

  const measuredRun = (n) => (state.measured ? state.measured.runs.find((run) => parseInt(run.stage, 10) === n) : null);

  function machineText(machine) {
    const arch = (String(machine.platform || "").match(/x86_64|aarch64|arm64|ppc64le|s390x/) || ["?"])[0];
    return t("tut.machine", { cores: machine.cpu_count, arch, isa: machine.cpu_capability, torch: machine.torch });
  }

  function table(caption, rows) {
    const figure = document.createElement("table");
    figure.innerHTML = "<caption></caption><thead><tr><th></th><th></th></tr></thead><tbody></tbody>";
    figure.querySelector("caption").textContent = caption;
    const heads = figure.querySelectorAll("th");
    heads[0].textContent = t("tut.col.meter");
    heads[1].textContent = t("tut.col.value");
    for (const [id, label, value, text] of rows) {
      const tr = document.createElement("tr");
      tr.dataset.row = id;
      tr.innerHTML = "<th scope=\"row\"></th><td></td>";
      tr.querySelector("th").textContent = label;
      const cell = tr.querySelector("td");
      cell.dataset.value = String(value);
      cell.textContent = text;
      figure.querySelector("tbody").appendChild(tr);
    }
    return figure;
  }

  function note(text, cls) {
    const p = document.createElement("p");
    p.className = cls;
    p.textContent = text;
    return p;
  }

  function nameOf(list, id) {
    const item = list.find((x) => x.id === id);
    return item ? item.name : id;
  }

  function renderSimulated(section, n) {
    const holder = section.querySelector("figure.sim");
    holder.replaceChildren();
    const preset = state.catalog && state.catalog.presets.find((p) => p.stage === n);
    if (state.simErrors[n]) holder.appendChild(note(t("tut.sim_failed", { message: state.simErrors[n] }), "sim-failed"));
    if (!preset || !state.sims[n]) return;
    const inputs = preset.inputs;
    const caption = t("tut.sim_caption", { n, model: nameOf(state.catalog.models, inputs.model),
      gpus: `${inputs.num_gpus}× ${nameOf(state.catalog.gpus, inputs.gpu)}` });
    const r = state.sims[n];
    holder.appendChild(table(caption, SIM_ROWS.map(([id, label, value, format]) => [id, t(label), value(r), format(value(r))])));
    holder.dataset.ready = "true";
  }

  function renderMeasured(section, n) {
    const holder = section.querySelector("figure.measured");
    holder.replaceChildren();
    if (state.measuredError) {
      holder.appendChild(note(t("tut.measured_missing", { message: state.measuredError }), "not-measured"));
      return;
    }
    if (!state.measured) return;
    const run = measuredRun(n);
    if (!run) {
      holder.appendChild(note(t("tut.not_measured", { n }), "not-measured"));
      holder.dataset.measured = "false";
      return;
    }
    const caption = t("tut.measured_caption", { machine: machineText(state.measured.machine), model: run.model_id });
    holder.appendChild(table(caption, MEASURED_ROWS.map(([field, label, format]) => [field, t(label), run[field], format(run[field])])));
    holder.dataset.measured = "true";
  }

  function delta(key, prev, from, to) {
    return t(key, { prev, ttft_from: ms(from.p99_ttft_ms), ttft_to: ms(to.p99_ttft_ms), tpot_from: ms(from.p99_tpot_ms),
      tpot_to: ms(to.p99_tpot_ms), tps_from: tps(from.output_throughput), tps_to: tps(to.output_throughput) });
  }

  function renderDeltas(section, n) {
    const sim = section.querySelector(".delta-sim");
    const measured = section.querySelector(".delta-measured");
    const [a, b] = [state.sims[n - 1], state.sims[n]];
    sim.textContent = a && b && a.fits && b.fits ? delta("tut.delta_sim", n - 1, a.metrics, b.metrics) : "";
    const [x, y] = [measuredRun(n - 1), measuredRun(n)];
    measured.textContent = x && y ? delta("tut.delta_measured", n - 1, x, y) : "";
  }

  // what routing by cached prefix changes on the card's own inputs (stage 6)
  function renderRouter(section, n) {
    const line = section.querySelector(".delta-router");
    if (!line) return;
    const [a, b] = [state.baselines[n], state.sims[n]];
    const hits = (r) => r.meters.prefix_cache.hit_rate;
    line.textContent = a && b && a.fits && b.fits && a.meters.prefix_cache && b.meters.prefix_cache
      ? t("tut.delta_router", { hits_from: pct(hits(a)), hits_to: pct(hits(b)),
        ttft_from: ms(a.metrics.median_ttft_ms), ttft_to: ms(b.metrics.median_ttft_ms),
        p99_from: ms(a.metrics.p99_ttft_ms), p99_to: ms(b.metrics.p99_ttft_ms),
        tps_from: tps(a.metrics.output_throughput), tps_to: tps(b.metrics.output_throughput) }) : "";
  }

  function render() {
    const m = state.measured;
    if (m) {
      $("measured-label").textContent = t("tut.measured_label", { model: m.model_id, machine: machineText(m.machine),
        date: String(m.date).split(" ")[0], workload: t("tut.measured_workload", { n: num(m.num_prompts),
          input: num(m.input_len), output: num(m.output_len), rate: num(m.request_rate, 2), slots: m.max_num_seqs }) });
      $("measured-command").textContent = m.command;
    }
    document.querySelectorAll(".tut-stage").forEach((section) => {
      const n = Number(section.dataset.stage);
      renderSimulated(section, n);
      renderMeasured(section, n);
      renderDeltas(section, n);
      renderRouter(section, n);
    });
  }

  async function loadMeasured() {
    try {
      const response = await fetch("/lab/static/measured/stages.json");
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      state.measured = await response.json();
    } catch (err) {
      state.measuredError = err.message;
    }
    render();
  }

  async function loadSimulated() {
    const response = await fetch("/lab/api/catalog");
    state.catalog = await response.json();
    for (const preset of state.catalog.presets) {
      try {
        state.sims[preset.stage] = await simulate(preset.inputs);
        if (preset.inputs.router === "prefix") {
          state.baselines[preset.stage] = await simulate({ ...preset.inputs, router: "least-loaded" });
        }
      } catch (err) {
        state.simErrors[preset.stage] = err.message;
      }
      render();
    }
  }

  async function init() {
    await window.LabI18n.ready;
    window.LabI18n.onChange(render);
    try {
      await Promise.all([loadMeasured(), loadSimulated()]);
    } catch (err) {
      state.simErrors = Object.fromEntries([1, 2, 3, 4, 5, 6].map((n) => [n, err.message]));
      render();
    }
    $("tutorial-status").hidden = true;
    document.body.dataset.status = "ready";
  }

  init();
})();
