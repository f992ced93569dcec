// 分步讲解 / step by step: after an evolution card is clicked, which meters moved between the previous simulation
// and the card's, and why. The reasons are keyed by what the card changed (walk.why.<cause>.<meter>.<up|down>).
"use strict";

window.LabWalkthrough = (() => {
  const { t, tn, has, fmt } = window.LabI18n;
  const tps = (x) => t("fmt.tok_s", { n: fmt.num(x) });
  const gibText = (x) => `${fmt.gib(x)} GiB`;
  // [meter, value of a simulate answer, format, smallest change worth a sentence: [absolute, relative]]
  const METERS = [
    ["kv", (r) => r.meters.kv_cache.peak_usage, fmt.pct, [0.05, 0]],
    ["weights", (r) => r.meters.weights.bytes_per_gpu, gibText, [0, 0.05]],
    ["ttft", (r) => r.metrics.p99_ttft_ms, fmt.ms, [0, 0.1]],
    ["tpot", (r) => r.metrics.p99_tpot_ms, fmt.ms, [0, 0.1]],
    ["throughput", (r) => r.metrics.output_throughput, tps, [0, 0.05]],
    ["decode", (r) => r.meters.decode_throughput.utilization, fmt.pct, [0.05, 0]],
    ["slots", (r) => r.meters.batch_slots.mean_saturation, fmt.pct, [0.05, 0]],
    ["queue", (r) => r.meters.queue.mean_queue_ms, fmt.ms, [1, 0.1]],
    ["goodput", (r) => r.meters.goodput.slo_attainment, fmt.pct, [0.05, 0]],
    ["transfer", (r) => (r.meters.kv_transfer ? r.meters.kv_transfer.mean_ms : null), fmt.ms, [0, 0.1]],
    ["hits", (r) => (r.meters.prefix_cache ? r.meters.prefix_cache.hit_rate : null), fmt.pct, [0.02, 0]],
  ];
  const MAX_MOVES = 5;
  // the meters each change is about, listed first whatever else moved more
  const PRIMARY = { batch: ["throughput", "ttft"], continuous: ["ttft", "kv"], tp: ["weights", "tpot", "kv"],
    pd: ["transfer", "tpot", "ttft", "throughput"], prefix: ["hits", "ttft", "tpot"] };
  // meters that matter when they hold still: [cause, meter]
  const STEADY = [["pd", "tpot"]];

  // What the card changed, earliest stage first: serial -> static batches -> continuous -> TP -> P/D split ->
  // routing replicas by their cached prefixes.
  function causes(before, after) {
    const out = [];
    if (before.schedule === "serial" && after.schedule === "static") out.push("batch");
    if (before.schedule !== "continuous" && after.schedule === "continuous") out.push("continuous");
    if (after.tp > before.tp) out.push("tp");
    if (after.disaggregate && !before.disaggregate) out.push("pd");
    if (after.router === "prefix" && before.router !== "prefix") out.push("prefix");
    if (!out.length) out.push("back");
    return out;
  }

  function reason(found, meter, direction) {
    for (const cause of found) {
      for (const key of [`walk.why.${cause}.${meter}.${direction}`, `walk.why.${cause}.${meter}`]) {
        if (has(key)) return key;
      }
    }
    return "walk.why.side";
  }

  function moves(from, to, found, params) {
    const out = [];
    for (const [meter, value, format, [absolute, relative]] of METERS) {
      const a = value(from.result);
      const b = value(to.result);
      if (a == null && b == null) continue;
      if (a == null || b == null) {
        const direction = a == null ? "appear" : "vanish";
        out.push({ meter, size: Infinity, text: t(`walk.move.${direction}`, {
          meter: t(`walk.meter.${meter}`), value: format(a ?? b),
          why: t(reason(found, meter, direction), params) }) });
        continue;
      }
      const change = Math.abs(b - a);
      const ratio = Math.abs(Math.log(Math.max(b, 1e-9) / Math.max(a, 1e-9)));
      if (change <= absolute || ratio <= Math.log1p(relative) || change === 0) continue;
      const direction = b > a ? "up" : "down";
      out.push({ meter, size: ratio, text: t(`walk.move.${direction}`, {
        meter: t(`walk.meter.${meter}`), from: format(a), to: format(b),
        why: t(reason(found, meter, direction), params) }) });
    }
    const primary = found.flatMap((cause) => PRIMARY[cause] || []);
    const rank = (m) => (primary.includes(m.meter) ? primary.indexOf(m.meter) : primary.length);
    out.sort((x, y) => rank(x) - rank(y) || y.size - x.size);
    const shown = out.slice(0, MAX_MOVES);
    for (const [cause, meter] of STEADY) {
      const spec = METERS.find(([id]) => id === meter);
      if (found.includes(cause) && !out.some((m) => m.meter === meter)) {
        shown.push({ meter, text: t(`walk.steady.${cause}.${meter}`, { ...params, value: spec[2](spec[1](to.result)) }) });
      }
    }
    return shown;
  }

  // from, to: {body, result} of the simulations before and after the click; stage: the card's number.
  function explain(from, to, stage) {
    const title = t(`stage.${stage}.title`);
    const lead = t("walk.lead", { stage, title });
    if (!to.result.fits) return { lead, items: [t("walk.nofit")] };
    if (!from || !from.result.fits) return { lead, items: [t("walk.first")] };
    const body = to.body;
    const split = body.disaggregate ? body.disaggregate.split(":") : [0, 0];
    const params = { tp: body.tp, gpus: body.num_gpus, slots: body.max_num_seqs, prefill: split[0], decode: split[1],
      input_len: fmt.num(body.input_len ?? 0), output_len: fmt.num(body.output_len ?? 0), rate: fmt.num(Number(body.request_rate) || 0, 2),
      replicas: tn("fmt.replicas", body.num_gpus / body.tp), prefixes: fmt.num(body.num_prefixes ?? 0),
      prefix_len: fmt.num(body.prefix_len ?? 0) };
    const items = moves(from, to, causes(from.body, body), params).map((m) => m.text);
    return { lead, items: items.length ? items : [t("walk.none")] };
  }

  function render(view) {
    const box = document.getElementById("walkthrough");
    const lead = document.getElementById("walk-lead");
    const list = document.getElementById("walk-moves");
    list.replaceChildren();
    if (!view) {
      box.dataset.state = "idle";
      lead.textContent = t("walk.idle");
      return;
    }
    const { lead: text, items } = explain(view.from, view.to, view.stage);
    lead.textContent = text;
    for (const item of items) {
      const li = document.createElement("li");
      li.textContent = item;
      list.appendChild(li);
    }
    box.dataset.state = "ready";
    box.dataset.stage = String(view.stage);
  }

  return { explain, render };
})();
