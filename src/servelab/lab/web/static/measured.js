// The lab page's measured-path panel: `servelab bench stages` results (GET /lab/api/measured: the copy the page
// ships and those in the results folder), each stage beside the lab's prediction for the same workload on this
// machine, as a table and a bar plot; under `servelab serve`, "measure here" runs a short comparison in the
// background (POST /lab/api/measure) and shows its progress. Every string comes from LabI18n (i18n.js).
"use strict";

(() => {
  const POLL_MS = 1000;
  const { t, fmt } = window.LabI18n;
  const { num, ms } = fmt;
  const COLUMNS = [["output_throughput", "ms.col_tok_s", (x) => num(x, 1)], ["median_ttft_ms", "ms.col_ttft_p50", ms],
    ["p99_ttft_ms", "ms.col_ttft_p99", ms], ["median_tpot_ms", "ms.col_tpot_p50", ms]];
  const $ = (id) => document.getElementById(id);
  const sleep = (msDelay) => new Promise((resolve) => setTimeout(resolve, msDelay));
  let data = null;

  const stageName = (run) => t(`stage.${parseInt(run.stage, 10)}.name`);
  const cell = (tag, text, cls) => {
    const el = document.createElement(tag);
    el.textContent = text;
    if (cls) el.className = cls;
    return el;
  };

  function renderSet(set) {
    const box = document.createElement("article");
    box.className = "ms-set";
    const m = set.machine || {};
    box.append(cell("h3", t(set.source === "shipped" ? "ms.set_shipped" : "ms.set_here", {
      model: set.model_id, date: String(set.date || "").split(" ")[0] })));
    const w = set.workload;
    box.append(cell("p", `${t("ms.machine", { cpus: m.cpu_count ?? "?", isa: m.cpu_capability ?? "?",
      torch: m.torch ?? "?" })} · ${t("ms.workload", { n: w.num_prompts, rate: num(w.request_rate, 2), input: w.input_len,
      output: w.output_len, seqs: w.max_num_seqs })}`, "note"));
    const table = document.createElement("table");
    table.className = "ms-table";
    const head = document.createElement("tr");
    head.append(cell("th", t("ms.col_stage")));
    COLUMNS.forEach(([, key]) => head.append(cell("th", `${t(key)} · ${t("ms.measured")}`), cell("th", t("ms.predicted"), "pred")));
    table.append(head);
    const unpriced = []; // stages the profile cannot price: the server's reason as a tooltip
    set.runs.forEach((run, i) => {
      const row = document.createElement("tr");
      row.dataset.schedule = run.schedule;
      row.append(cell("td", stageName(run)));
      const predicted = set.predicted ? set.predicted[i] : null;
      if (predicted && predicted.error) unpriced.push([parseInt(run.stage, 10), predicted.error]);
      COLUMNS.forEach(([field, , format]) => {
        row.append(cell("td", run[field] == null ? "–" : format(run[field])));
        row.append(cell("td", predicted && predicted[field] != null ? format(predicted[field]) : "–", "pred"));
      });
      table.append(row);
    });
    box.append(table);
    if (set.prediction_error) {
      const note = cell("p", t("ms.no_profile"), "note");
      note.title = set.prediction_error;
      box.append(note);
    }
    if (unpriced.length) {
      const note = cell("p", t("ms.no_stage_timing", { stages: unpriced.map(([n]) => n).join(", ") }), "note ms-unpriced");
      note.title = unpriced.map(([n, why]) => `${n}: ${why}`).join("\n");
      box.append(note);
    }
    box.append(barPlot(set));
    return box;
  }

  // Output tokens/s per stage: measured (filled) and predicted (outlined) side by side.
  function barPlot(set) {
    const W = 420, H = 130, left = 40, bottom = 20, group = (W - left) / Math.max(set.runs.length, 1);
    const values = set.runs.flatMap((r, i) => [r.output_throughput || 0,
      (set.predicted && set.predicted[i].output_throughput) || 0]);
    const top = Math.max(...values, 1e-9);
    const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    svg.classList.add("ms-plot");
    const add = (name, attrs, text) => {
      const el = document.createElementNS("http://www.w3.org/2000/svg", name);
      Object.entries(attrs).forEach(([k, v]) => el.setAttribute(k, v));
      if (text != null) el.textContent = text;
      svg.append(el);
    };
    add("text", { x: left - 4, y: 10, "text-anchor": "end" }, num(top, 0));
    add("line", { x1: left, y1: H - bottom, x2: W, y2: H - bottom, class: "axis" });
    set.runs.forEach((run, i) => {
      const x0 = left + i * group + group * 0.15, bar = group * 0.33;
      const h = (v) => (v / top) * (H - bottom - 14);
      const measured = run.output_throughput || 0;
      add("rect", { x: x0, y: H - bottom - h(measured), width: bar, height: h(measured), class: "measured-bar" });
      const predicted = set.predicted ? set.predicted[i].output_throughput || 0 : 0;
      add("rect", { x: x0 + bar + 2, y: H - bottom - h(predicted), width: bar, height: h(predicted), class: "predicted-bar" });
      add("text", { x: x0 + bar, y: H - 5, "text-anchor": "middle" }, String(parseInt(run.stage, 10)));
    });
    const figure = document.createElement("figure");
    figure.className = "ms-figure";
    figure.append(svg, cell("figcaption", t("ms.plot_caption"), "note"));
    return figure;
  }

  function render() {
    if (!data) return;
    $("ms-sets").replaceChildren(...data.sets.map(renderSet));
    $("measured").dataset.sets = String(data.sets.length);
    $("measured").dataset.status = "ready";
  }

  async function load() {
    const response = await fetch(window.LabI18n.api("/lab/api/measured"));
    if (response.status === 429) { // the page's own simulation holds the lab: try again shortly
      setTimeout(load, POLL_MS);
      return;
    }
    data = await response.json();
    render();
  }

  function showJob(job) {
    $("ms-actions").hidden = !job.can_measure;
    $("ms-run").disabled = job.state === "running";
    const progress = {
      running: () => t("ms.progress", { stage: Math.max(job.stage, 1), n: job.num_stages }),
      done: () => t("ms.done", { name: job.name }), failed: () => t("ms.failed"), idle: () => "",
    }[job.state];
    $("ms-progress").textContent = progress ? progress() : "";
    $("measured").dataset.job = job.state;
  }

  async function poll() {
    const job = await (await fetch("/lab/api/measure")).json();
    showJob(job);
    if (job.state === "running") setTimeout(poll, POLL_MS);
    else if (job.state === "done") load();
  }

  async function measure() {
    const response = await fetch(window.LabI18n.api("/lab/api/measure"), { method: "POST" });
    const payload = await response.json();
    if (!response.ok) {
      $("ms-progress").textContent = (payload.error || {}).message || response.statusText;
      return;
    }
    showJob(payload);
    setTimeout(poll, POLL_MS);
  }

  // After the page's first simulation: the lab runs one job at a time, and the meters come first.
  async function afterFirstSimulation() {
    for (let i = 0; i < 240 && !["ready", "error"].includes($("meters").dataset.status); i++) await sleep(250);
  }

  async function init() {
    await window.LabI18n.ready;
    $("ms-run").addEventListener("click", measure);
    window.LabI18n.onChange(() => { render(); poll(); });
    await poll();
    await afterFirstSimulation();
    await load();
  }

  init();
})();
