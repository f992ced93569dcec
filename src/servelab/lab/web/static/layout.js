// 进程布局 / process layout: the processes `servelab serve` runs right now (GET /lab/api/live/layout): the API
// server, each engine core with its role (colocated, or prefill / decode under --disaggregate) and its
// tensor-parallel ranks with their pids, and the KV handoffs between P/D instances. Redrawn every few seconds.
"use strict";

window.LabLayout = (() => {
  const { t, fmt } = window.LabI18n;
  const REFRESH_MS = 3000;
  const ROLES = { colocated: "live.layout.role_colocated", prefill: "live.layout.role_prefill",
    decode: "live.layout.role_decode" };
  let last = null;

  function box(cls, title, detail) {
    const el = document.createElement("div");
    el.className = cls;
    const head = document.createElement("span");
    head.className = "layout-title";
    head.textContent = title;
    el.appendChild(head);
    if (detail) {
      const sub = document.createElement("span");
      sub.className = "layout-detail";
      sub.textContent = detail;
      el.appendChild(sub);
    }
    return el;
  }

  function render(layout) {
    const root = document.getElementById("live-layout");
    if (!root || !layout) return;
    last = layout;
    root.replaceChildren();
    root.dataset.tp = String(layout.tensor_parallel_size);
    root.dataset.engines = String(layout.data_parallel_size);
    root.appendChild(box("layout-api", t("live.layout.api_server"),
      t("live.layout.pid_host", { pid: layout.api_server_pid, host: layout.host })));
    const engines = document.createElement("div");
    engines.className = "layout-engines";
    for (const engine of layout.engines) {
      const role = ROLES[engine.role] ? t(ROLES[engine.role]) : engine.role;
      const el = box("layout-engine", t("live.layout.engine_core", { i: engine.engine_index, role }),
        t(engine.alive ? "live.layout.pid" : "live.layout.pid_dead", { pid: engine.pid }));
      el.dataset.role = engine.role;
      el.dataset.alive = String(engine.alive);
      const ranks = document.createElement("div");
      ranks.className = "layout-ranks";
      for (const rank of engine.ranks) {
        const r = box("layout-rank", t("live.layout.rank", { rank: rank.rank }),
          rank.pid === engine.pid ? t("live.layout.in_core")
            : t("live.layout.pid_host", { pid: rank.pid, host: rank.host }));
        r.dataset.pid = String(rank.pid);
        ranks.appendChild(r);
      }
      el.appendChild(ranks);
      if (engine.quantization) {
        const q = box("layout-quantization", t("live.layout.quantization",
          { mode: engine.quantization, kv: engine.kv_cache_dtype }), engine.quantization_reason);
        q.dataset.mode = engine.quantization;
        q.dataset.kv = engine.kv_cache_dtype;
        el.appendChild(q);
      }
      if (engine.role !== "colocated") {
        el.appendChild(box("layout-handoffs", t("live.layout.handoffs", { n: fmt.num(engine.num_kv_handoffs) })));
      }
      engines.appendChild(el);
    }
    root.appendChild(engines);
    root.dataset.updates = String(Number(root.dataset.updates || 0) + 1);
  }

  async function refresh(url) {
    try {
      const response = await fetch(url);
      if (response.ok) render(await response.json());
    } catch (err) {
      // the server is going away: the last drawing stays
    }
  }

  function start(url) {
    refresh(url);
    setInterval(() => refresh(url), REFRESH_MS);
    window.LabI18n.onChange(() => render(last));
  }

  // The deployment shape of the processes drawn last, in the lab's terms: TP degree, engine cores, and the
  // prefill:decode split when the server runs --disaggregate; null before the first answer.
  function shape() {
    if (!last) return null;
    const count = (role) => last.engines.filter((e) => e.role === role).length;
    const prefill = count("prefill");
    const decode = count("decode");
    return { tp: last.tensor_parallel_size, engines: last.engines.length,
      disaggregate: prefill && decode ? `${prefill}:${decode}` : null };
  }

  return { start, shape };
})();
