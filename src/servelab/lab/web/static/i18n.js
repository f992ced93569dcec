// The lab's two languages: the strings of /lab/static/i18n/<lang>.json, the 中文 / EN switch, and number formats.
// The choice comes from ?lang=, else from localStorage, else from the browser; it is remembered in localStorage.
"use strict";

window.LabI18n = (() => {
  const STORAGE_KEY = "servelab.lab.lang";
  const HTML_LANG = { en: "en", zh: "zh-CN" };
  const SWITCH = [["zh", "中文"], ["en", "EN"]]; // each language named in itself, first as on the seed page
  const catalogs = {};
  const listeners = [];
  const missing = [];
  let lang = "en";
  let strings = {};

  const normalize = (tag) => {
    const primary = String(tag || "").toLowerCase().split("-")[0];
    return primary in HTML_LANG ? primary : null;
  };

  function remembered() {
    try {
      return normalize(localStorage.getItem(STORAGE_KEY));
    } catch (err) {
      return null; // storage disabled: the choice lasts for the page only
    }
  }

  function remember(value) {
    try {
      localStorage.setItem(STORAGE_KEY, value);
    } catch (err) { /* storage disabled */ }
  }

  // [language, whether it is a choice to remember]: a link's is, the browser's default is not
  function initialLanguage() {
    const linked = normalize(new URLSearchParams(location.search).get("lang"));
    if (linked) return [linked, true];
    const stored = remembered();
    if (stored) return [stored, false];
    for (const tag of navigator.languages || [navigator.language]) {
      if (normalize(tag)) return [normalize(tag), false];
    }
    return ["en", false];
  }

  async function load(value) {
    if (!catalogs[value]) {
      const response = await fetch(`/lab/static/i18n/${value}.json`);
      if (!response.ok) throw new Error(`/lab/static/i18n/${value}.json: HTTP ${response.status}`);
      catalogs[value] = await response.json();
    }
    return catalogs[value];
  }

  const has = (key) => Object.prototype.hasOwnProperty.call(strings, key);

  // t("meter.kv") or t("fmt.tokens", {n: 5}); a key missing from the file is a bug, reported on the console.
  function t(key, params = {}) {
    let text = strings[key];
    if (typeof text !== "string") {
      missing.push(`${lang}:${key}`);
      console.error(`servelab lab: no ${lang} string for ${key}`);
      text = key;
    }
    return text.replace(/\{(\w+)\}/g, (whole, name) => (name in params ? String(params[name]) : whole));
  }

  // tn("fmt.replicas", 3): the key's ".one" form for 1, ".other" otherwise (Chinese has the same text in both).
  const tn = (key, n, params = {}) => t(`${key}.${n === 1 ? "one" : "other"}`, { n: num(n), ...params });

  // A span showing key's text that apply() translates again when the language changes.
  function keyed(key) {
    const span = document.createElement("span");
    span.dataset.i18n = key;
    span.textContent = t(key);
    return span;
  }

  function apply(root = document) {
    root.querySelectorAll("[data-i18n]").forEach((el) => { el.textContent = t(el.dataset.i18n); });
    // our own files' markup (<strong>, <code>, links), never text from a request
    root.querySelectorAll("[data-i18n-html]").forEach((el) => { el.innerHTML = t(el.dataset.i18nHtml); });
    root.querySelectorAll("[data-i18n-attr]").forEach((el) => {
      for (const pair of el.dataset.i18nAttr.split(";")) {
        const [attr, key] = pair.split(":");
        el.setAttribute(attr.trim(), t(key.trim()));
      }
    });
    root.querySelectorAll("a[data-lang-link]").forEach((a) => {
      const url = new URL(a.getAttribute("href"), location.href);
      url.searchParams.set("lang", lang);
      a.setAttribute("href", url.pathname + url.search + url.hash);
    });
    document.documentElement.lang = HTML_LANG[lang];
    document.querySelectorAll("#lang-switch button").forEach((b) => {
      b.setAttribute("aria-pressed", String(b.dataset.lang === lang));
    });
  }

  function buildSwitch() {
    const holder = document.getElementById("lang-switch");
    if (!holder) return;
    for (const [value, name] of SWITCH) {
      const button = document.createElement("button");
      button.type = "button";
      button.id = `lang-${value}`;
      button.dataset.lang = value;
      button.lang = HTML_LANG[value];
      button.textContent = name;
      button.addEventListener("click", () => { setLanguage(value, true); });
      holder.appendChild(button);
    }
  }

  async function setLanguage(value, chosen) {
    const next = normalize(value) || "en";
    strings = await load(next);
    lang = next;
    if (chosen) remember(next);
    const url = new URL(location.href);
    if (url.searchParams.has("lang")) { // keep a shared link's language in step with the switch
      url.searchParams.set("lang", next);
      history.replaceState(history.state, "", url);
    }
    apply();
    listeners.forEach((listener) => listener(next));
  }

  async function start() {
    buildSwitch();
    try {
      await setLanguage(...initialLanguage());
    } finally {
      document.documentElement.classList.remove("i18n-loading");
    }
  }

  // ---- number formats (the same digits and separators in both languages)
  const num = (x, digits = 0) => Number(x).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
  const pct = (x) => `${num(x * 100, x > 0 && x < 0.1 ? 1 : 0)}%`;
  const gib = (bytes) => num(bytes / 2 ** 30, 1);
  const ms = (x) => {
    if (x == null) return "–";
    if (x >= 10000) return `${num(x / 1000, 0)} s`;
    if (x >= 1000) return `${num(x / 1000, 1)} s`;
    return `${num(x, x < 10 ? 1 : 0)} ms`;
  };

  const api = (path) => `${path}${path.includes("?") ? "&" : "?"}lang=${lang}`;
  const sleep = (msDelay) => new Promise((resolve) => setTimeout(resolve, msDelay));

  // POST a lab API request in the page's language, waiting out 429s (the lab's worker busy; onWait is told each
  // time); the answer's JSON, or an Error with the API's message (in the page's language).
  async function post(path, body, onWait = () => {}, maxRetries = 120) {
    for (let attempt = 0; attempt <= maxRetries; attempt++) {
      const response = await fetch(api(path), {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
      });
      if (response.status === 429) {
        onWait();
        await sleep(1000 * Number(response.headers.get("Retry-After") || 1));
        continue;
      }
      const payload = await response.json();
      if (!response.ok) throw new Error((payload.error || {}).message || response.statusText);
      return payload;
    }
    throw new Error(t("error.busy"));
  }

  return {
    ready: start(),
    t, tn, has, apply, setLanguage, missing,
    lang: () => lang,
    onChange: (listener) => listeners.push(listener),
    keyed,
    api,
    post,
    fmt: { num, pct, gib, ms },
  };
})();
