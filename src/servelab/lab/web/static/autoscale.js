// The lab page's autoscaling panel: the page's current inputs with a rate schedule and an autoscaler ->
// POST /lab/api/simulate (what `servelab lab simulate --rate-schedule ... --autoscale ... --json` prints) ->
// plots of load, replicas, queue, KV usage and running batch over time, the decision line, and where the
// latency of the requests that missed a target went. Every string comes from LabI18n (i18n.js).
"use strict";

(() => {
  const INTERVAL_S = 15;
  const MAX_BUSY_RETRIES = 120;
  // servelab/lab/analysis/slo_attribution.py PARTS: a TTFT miss's three, then a TPOT miss's four
  const PARTS = ["queued", "prefill_wait", "prefill", "kv_transfer", "decode_interference", "decode_batch", "decode"];
  const PART_COLORS = ["#c2410c", "#f08a4b", "#2f6fde", "#8b5cf6", "#e0a100", "#7fb069", "#1f8f55"];
  const W = 300, H = 120, PAD_L = 34, PAD_B = 18, PAD_T = 6;
  const { t, fmt } = window.LabI18n;
  const { num, pct, ms } = fmt;
  const $ = (id) => document.getElementById(id);
  let last = null; // {body, result} shown
  let advised = null; // the autoscaler settings the advisor is asked about, once the panel has run

  // The panel's settings as the API's fields (`--rate-schedule` and the `--autoscale` flags), for simulate and advise.
  function settings() {
    return {
      rate_schedule: $("as-schedule").value, autoscale: $("as-policy").value, min_replicas: 1,
      max_replicas: Math.max(1, parseInt($("as-max").value, 10) || 1), startup_s: Number($("as-startup").value) || 0,
      cooldown_s: Number($("as-cooldown").value) || 0, interval_s: INTERVAL_S,
    };
  }

  function requestBody() {
    const body = window.LabPage.body();
    return { ...body, ...settings(), slo_attribution: body.ttft_target_ms != null || body.tpot_target_ms != null };
  }

  // The schedule's label as the panel's list shows it (the value itself for one not in the list).
  function scheduleLabel(value) {
    const option = [...$("as-schedule").options].find((o) => o.value === value);
    return option ? option.textContent : value;
  }

  // The advisor then sizes for the schedule and cites the autoscaled comparison; "constant rate" asks it plainly.
  function adviseWith(fields) {
    advised = fields;
    window.LabPage.readvise();
  }

  // re-translated on a switch while it waits
  const post = (body) => window.LabI18n.post("/lab/api/simulate", body,
    () => $("as-status").replaceChildren(window.LabI18n.keyed("status.waiting")), MAX_BUSY_RETRIES);

  async function run() {
    const panel = $("autoscale");
    const body = requestBody();
    $("as-run").disabled = true;
    panel.dataset.status = "busy";
    $("as-status").className = "run-status busy";
    $("as-status").textContent = t("status.simulating");
    const started = performance.now();
    try {
      const result = await post(body);
      last = { body, result, seconds: (performance.now() - started) / 1000 };
      render();
      panel.dataset.status = result.autoscaling ? "ready" : "error";
      if (result.autoscaling) adviseWith(settings());
    } catch (err) {
      last = null;
      $("as-status").className = "run-status";
      $("as-status").textContent = t("error.not_run", { message: err.message });
      panel.dataset.status = "error";
    } finally {
      $("as-run").disabled = false;
    }
  }

  // The pools' columns summed (replicas, queue, running) or averaged (KV usage) at each scrape.
  function combined(timeline) {
    const pools = Object.values(timeline);
    const sum = (key) => pools[0][key].map((_, i) => pools.reduce((acc, p) => acc + p[key][i], 0));
    const replicas = pools[0].num_ready.map((_, i) => pools.reduce(
      (acc, p) => acc + p.num_ready[i] + p.num_starting[i] + p.num_draining[i], 0));
    return {
      time: pools[0].time_s, load: sum("arrival_rate"), ready: sum("num_ready"), replicas,
      waiting: sum("num_waiting"), running: sum("num_running"),
      kv: sum("kv_usage").map((x) => x / pools.length),
    };
  }

  function render() {
    if (!last) return;
    const { result, seconds } = last;
    $("as-status").className = "run-status";
    $("as-status").textContent = t("status.simulated", { s: num(seconds, 2) });
    if (!result.autoscaling) {
      $("as-decision").textContent = result.reason || "";
      $("as-plots").replaceChildren();
      $("as-misses").hidden = true;
      return;
    }
    const a = result.autoscaling;
    const c = combined(a.timeline);
    $("autoscale").dataset.replicas = JSON.stringify(c.ready);
    $("as-decision").textContent = decision(a);
    $("as-plots").replaceChildren(
      plot(t("as.plot_replicas"), c.time, [[c.replicas, t("as.key_replicas")], [c.load, t("as.key_load")]]),
      plot(t("as.plot_queue"), c.time, [[c.waiting, t("as.key_waiting")]]),
      plot(t("as.plot_kv"), c.time, [[c.kv.map((x) => x * 100), t("as.key_kv")]]),
      plot(t("as.plot_running"), c.time, [[c.running, t("as.key_running")]]));
    renderMisses(result.slo_misses);
  }

  function decision(a) {
    const s = a.autoscaled, f = a.fixed, cfg = a.settings;
    const values = {
      policy: t(`as.policy_${cfg.policy}`), min: cfg.min_replicas, max: cfg.max_replicas,
      gpu_h: num(s.gpu_hours, 1), fixed_gpu_h: num(f.gpu_hours, 1), fixed_n: f.num_replicas_peak,
      saved: pct(a.gpu_hours_saved_share), p99: ms(s.p99_ttft_ms), fixed_p99: ms(f.p99_ttft_ms),
    };
    if (s.slo_attainment == null) return t("as.decision_no_slo", values);
    return t("as.decision", { ...values, att: pct(s.slo_attainment), fixed_att: pct(f.slo_attainment) });
  }

  function svgEl(name, attrs, text) {
    const el = document.createElementNS("http://www.w3.org/2000/svg", name);
    Object.entries(attrs).forEach(([k, v]) => el.setAttribute(k, v));
    if (text != null) el.textContent = text;
    return el;
  }

  // Each series on its own scale (its maximum named in the key), time in minutes along the bottom.
  function plot(title, time, series) {
    const box = document.createElement("div");
    box.className = "as-plot";
    const head = document.createElement("h3");
    head.textContent = title;
    const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
    const tMax = Math.max(...time, 1);
    const x = (v) => PAD_L + (v / tMax) * (W - PAD_L - 4);
    svg.append(svgEl("line", { class: "axis", x1: PAD_L, y1: H - PAD_B, x2: W - 4, y2: H - PAD_B }));
    svg.append(svgEl("line", { class: "axis", x1: PAD_L, y1: PAD_T, x2: PAD_L, y2: H - PAD_B }));
    svg.append(svgEl("text", { x: PAD_L, y: H - 4 }, "0"));
    svg.append(svgEl("text", { x: W - 4, y: H - 4, "text-anchor": "end" }, t("as.minutes", { n: num(tMax / 60, 0) })));
    const key = document.createElement("div");
    key.className = "as-key";
    series.forEach(([values, label], i) => {
      const top = Math.max(...values, 1e-9);
      const y = (v) => H - PAD_B - (v / top) * (H - PAD_B - PAD_T);
      const points = values.map((v, j) => `${x(time[j]).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
      svg.append(svgEl("polyline", { class: `s${i}`, points }));
      if (i === 0) svg.append(svgEl("text", { x: PAD_L - 3, y: PAD_T + 8, "text-anchor": "end" }, num(top, top < 10 ? 1 : 0)));
      const item = document.createElement("span");
      item.className = `k${i}`;
      item.textContent = `${i ? " · " : ""}${label} (${t("as.max", { n: num(top, top < 10 ? 1 : 0) })})`;
      key.append(item);
    });
    box.append(head, svg, key);
    return box;
  }

  function renderMisses(misses) {
    const box = $("as-misses");
    box.hidden = !misses;
    if (!misses) return;
    $("as-misses-line").textContent = t("as.misses_line", {
      n: num(misses.num_missed), total: num(misses.num_requests), ttft: num(misses.num_missed_ttft),
      tpot: num(misses.num_missed_tpot) });
    const bar = $("as-misses-bar");
    const legend = $("as-misses-legend");
    bar.replaceChildren();
    legend.replaceChildren();
    PARTS.forEach((part, i) => {
      const share = misses.share[part];
      const span = document.createElement("span");
      span.style.width = `${share * 100}%`;
      span.style.background = PART_COLORS[i];
      span.title = t(`as.part.${part}`);
      bar.append(span);
      const item = document.createElement("li");
      const swatch = document.createElement("i");
      swatch.style.background = PART_COLORS[i];
      item.append(swatch, `${t(`as.part.${part}`)} ${pct(share)} (${ms(misses.mean_ms[part])})`);
      item.dataset.part = part;
      legend.append(item);
    });
  }

  async function init() {
    await window.LabI18n.ready;
    $("as-run").addEventListener("click", run);
    $("advice-constant").addEventListener("click", () => adviseWith(null));
    window.LabI18n.onChange(render);
  }

  window.LabAutoscale = { adviseFields: () => advised, scheduleLabel };

  init();
})();
