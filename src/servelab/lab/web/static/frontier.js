// The lab page's cost frontier: the page's model, workload and targets over GPU types -> POST /lab/api/frontier
// (what `servelab lab advise --pareto --json` prints) -> the cheapest configuration meeting the targets, the
// $ per million tokens vs SLO attainment frontier as a plot and a table. Every string comes from LabI18n.
"use strict";

(() => {
  const GPUS = ["h100", "h200", "a100-80gb", "mi300x"];
  const MAX_PROMPTS = 200;  // a short workload: the search simulates every shape
  const W = 460, H = 220, PAD_L = 46, PAD_B = 28, PAD_T = 8, PAD_R = 8;
  const { t, fmt } = window.LabI18n;
  const { num, pct } = fmt;
  const $ = (id) => document.getElementById(id);
  let last = null;

  function requestBody() {
    const b = window.LabPage.body();
    const body = {
      model: b.model, gpus: GPUS.filter((g) => $(`fr-gpu-${g}`).checked), max_gpus: Number($("fr-max").value) || 8,
      router: b.router, dataset: b.dataset, prefix_len: b.prefix_len, num_prefixes: b.num_prefixes,
      num_prompts: Math.min(b.num_prompts, MAX_PROMPTS), input_len: b.input_len,
      output_len: b.output_len, range_ratio: b.range_ratio, request_rate: b.request_rate, burstiness: b.burstiness,
      seed: b.seed, ttft_target_ms: b.ttft_target_ms, tpot_target_ms: b.tpot_target_ms,
    };
    const price = $("fr-price-h100").value;
    if (price !== "") body.prices = { h100: Number(price) };
    return body;
  }

  // re-translated on a switch while it waits
  const post = (body) => window.LabI18n.post("/lab/api/frontier", body,
    () => $("fr-status").replaceChildren(window.LabI18n.keyed("status.waiting")));

  function svg(tag, attrs, text) {
    const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
    Object.entries(attrs).forEach(([k, v]) => el.setAttribute(k, v));
    if (text !== undefined) el.textContent = text;
    return el;
  }

  function plot(result) {
    const holder = $("fr-plot");
    holder.replaceChildren();
    const pts = result.points;
    if (!pts.length) return;
    const costs = pts.map((p) => Math.log10(p.usd_per_million_tokens));
    const lo = Math.floor(Math.min(...costs)), hi = Math.ceil(Math.max(...costs)) || lo + 1;
    const x = (a) => PAD_L + a * (W - PAD_L - PAD_R);
    const y = (c) => H - PAD_B - (Math.log10(c) - lo) / Math.max(hi - lo, 1e-9) * (H - PAD_B - PAD_T);
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "fr-svg", role: "img" });
    root.append(svg("line", { x1: PAD_L, y1: H - PAD_B, x2: W - PAD_R, y2: H - PAD_B, class: "fr-axis" }));
    root.append(svg("line", { x1: PAD_L, y1: PAD_T, x2: PAD_L, y2: H - PAD_B, class: "fr-axis" }));
    for (let e = lo; e <= hi; e++) {
      root.append(svg("text", { x: PAD_L - 4, y: y(10 ** e) + 3, "text-anchor": "end", class: "fr-tick" }, `$${num(10 ** e)}`));
    }
    [0, 0.5, 1].forEach((a) => root.append(svg("text", { x: x(a), y: H - PAD_B + 12, "text-anchor": "middle", class: "fr-tick" }, pct(a))));
    root.append(svg("text", { x: (PAD_L + W) / 2, y: H - 2, "text-anchor": "middle", class: "fr-label" }, t("fr.x_axis")));
    const colors = { h100: "#2f6fde", h200: "#1f8f55", "a100-80gb": "#8b5cf6", mi300x: "#c2410c" };
    pts.forEach((p) => {
      const dot = svg("circle", { cx: x(p.slo_attainment), cy: y(p.usd_per_million_tokens), r: 2.6,
                                  fill: colors[p.gpu] || "#666", "fill-opacity": 0.5, class: "fr-point" });
      dot.append(svg("title", {}, p.label));
      root.append(dot);
    });
    const line = result.cost_frontier.map((p) => `${x(p.slo_attainment)},${y(p.usd_per_million_tokens)}`).join(" ");
    root.append(svg("polyline", { points: line, class: "fr-frontier", fill: "none" }));
    if (result.cheapest) {
      root.append(svg("circle", { cx: x(result.cheapest.slo_attainment), cy: y(result.cheapest.usd_per_million_tokens),
                                  r: 6, class: "fr-cheapest" }));
    }
    holder.append(root);
    const legend = document.createElement("ul");
    legend.className = "as-legend";
    [...new Set(pts.map((p) => p.gpu))].forEach((g) => {
      const item = document.createElement("li");
      const swatch = document.createElement("i");
      swatch.style.background = colors[g] || "#666";
      item.append(swatch, g);
      legend.append(item);
    });
    holder.append(legend);
  }

  function table(result) {
    const body = $("fr-rows");
    body.replaceChildren();
    result.cost_frontier.forEach((p) => {
      const row = document.createElement("tr");
      [p.label, num(p.num_gpus), `$${num(p.usd_per_hour)}`, `$${p.usd_per_million_tokens.toFixed(3)}`,
       num(p.tokens_per_s_per_gpu), `${num(p.p99_ttft_ms)} ms`, pct(p.slo_attainment)].forEach((text) => {
        const cell = document.createElement("td");
        cell.textContent = text;
        row.append(cell);
      });
      body.append(row);
    });
  }

  function render() {
    if (!last) return;
    const r = last.result;
    const c = r.cheapest;
    $("fr-cheapest").textContent = c
      ? t("fr.cheapest", { label: c.label, gpus: num(c.num_gpus), per_hour: num(c.usd_per_hour),
                           per_million: c.usd_per_million_tokens.toFixed(3) })
      : t("fr.none", { count: num(r.num_simulated) });
    $("fr-status").className = "run-status";
    $("fr-status").textContent = t("fr.done", { count: num(r.num_simulated), seconds: last.seconds.toFixed(1) });
    plot(r);
    table(r);
    $("fr-table").hidden = false;
  }

  async function run() {
    const panel = $("frontier");
    const body = requestBody();
    $("fr-run").disabled = true;
    panel.dataset.status = "busy";
    $("fr-status").className = "run-status busy";
    $("fr-status").textContent = t("fr.searching");
    const started = performance.now();
    try {
      const result = await post(body);
      last = { body, result, seconds: (performance.now() - started) / 1000 };
      panel.dataset.cheapest = JSON.stringify(result.cheapest);
      panel.dataset.body = JSON.stringify(body);
      render();
      panel.dataset.status = "ready";
    } catch (err) {
      last = null;
      $("fr-status").className = "run-status";
      $("fr-status").textContent = t("error.not_run", { message: err.message });
      panel.dataset.status = "error";
    } finally {
      $("fr-run").disabled = false;
    }
  }

  async function init() {
    await window.LabI18n.ready;
    $("fr-run").addEventListener("click", run);
    window.LabI18n.onChange(render);
  }

  init();
})();
