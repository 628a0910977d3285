// tollgate dashboard: polls the admin API every 2 s and draws what it answers. The token comes
// from the URL fragment (#token=..., never sent to the server) or the form, and is kept in
// sessionStorage for this tab only. Every value is written with textContent, never as HTML.
"use strict";

const POLL_MS = 2000;
const KEY = "tollgate.admin-token";
const SVG = "http://www.w3.org/2000/svg";
const PALETTE = ["#d9480f", "#2f5fd0", "#9b3fd1", "#0f8f9a", "#c0265e", "#7a8a12", "#b7791f", "#475569"];

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") e.className = v;
    else e.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null) continue;
    e.append(c instanceof Node ? c : String(c));
  }
  return e;
}

function svg(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  return e;
}

const int = (n) => (n ?? 0).toLocaleString("en-US");
function rate(r) {
  if (!r) return "0";
  if (r < 0.1) return r.toFixed(2);
  if (r < 10) return r.toFixed(1);
  return Math.round(r).toLocaleString("en-US");
}
function duration(s) {
  if (s === null || s === undefined) return "—";
  s = Math.max(0, Math.round(s));
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m " + (s % 60) + "s";
  if (s < 86400) return Math.floor(s / 3600) + "h " + Math.floor((s % 3600) / 60) + "m";
  return Math.floor(s / 86400) + "d " + Math.floor((s % 86400) / 3600) + "h";
}
const last = (a) => (a && a.length ? a[a.length - 1] : 0);
// The rate now: the mean of the last two steps, so one quiet step does not read as zero.
const now = (a) => (a && a.length > 1 ? (a[a.length - 1] + a[a.length - 2]) / 2 : last(a));
const table = (head, rows) =>
  el("table", {}, el("thead", {}, el("tr", {}, head.map(([t, cls]) => el("th", { class: cls }, t)))), el("tbody", {}, rows));
const pill = (cls, text) => el("span", { class: "pill " + cls }, text);
const empty = (text) => el("div", { class: "empty" }, text);

// === token ===

function takeFragmentToken() {
  const m = /(?:^#|&)token=([^&]*)/.exec(location.hash);
  if (!m) return;
  sessionStorage.setItem(KEY, decodeURIComponent(m[1]));
  // Out of the address bar, the history and any screenshot.
  history.replaceState(null, "", location.pathname + location.search);
}

function showLogin(message) {
  sessionStorage.removeItem(KEY);
  $("app").hidden = true;
  $("signout").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  status("", "signed out");
  $("token").focus();
}

$("login").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const t = $("token").value.trim();
  if (!t) return;
  sessionStorage.setItem(KEY, t);
  $("token").value = "";
  start();
});
$("signout").addEventListener("click", () => showLogin(""));

function status(cls, text) {
  $("status").className = cls;
  $("status-text").textContent = text;
}

// === polling ===

let timer = null;

async function api(path) {
  const res = await fetch("/api/v1/" + path, {
    headers: { Authorization: "Bearer " + sessionStorage.getItem(KEY) },
    cache: "no-store",
  });
  if (res.status === 401) throw Object.assign(new Error("unauthorized"), { unauthorized: true });
  if (res.status === 404) return { missing: true };
  if (!res.ok) throw new Error("HTTP " + res.status);
  return res.json();
}

// An optional endpoint: its answer, `missing` for a 404, `failed` for any other failure.
const optional = (path) => api(path).catch((e) => (e.unauthorized ? Promise.reject(e) : { failed: String(e.message) }));

async function poll() {
  clearTimeout(timer);
  try {
    const [data, bans, overrides] = await Promise.all([api("dashboard"), optional("bans"), optional("overrides")]);
    if (data.missing) throw new Error("the admin API answered 404: is admin.token_file set?");
    render(data, bans, overrides);
    status("live", "live · updated " + new Date().toLocaleTimeString("en-GB"));
  } catch (e) {
    if (e.unauthorized) return showLogin("The token was refused.");
    status("lost", "no answer (" + e.message + "), retrying");
  }
  timer = setTimeout(poll, POLL_MS);
}

function start() {
  if (!sessionStorage.getItem(KEY)) return showLogin("");
  $("login").hidden = true;
  $("app").hidden = false;
  $("signout").hidden = false;
  poll();
}

// === drawing ===

// A sparkline of `points` (oldest first) as an area under a line.
function spark(points, color, max) {
  const w = 120, h = 26;
  const s = svg("svg", { class: "spark", width: w, height: h, viewBox: `0 0 ${w} ${h}`, "aria-hidden": "true" });
  const top = Math.max(max || 0, ...points, 1e-9);
  const step = points.length > 1 ? w / (points.length - 1) : w;
  const xy = points.map((p, i) => [i * step, h - 1 - (p / top) * (h - 3)]);
  const line = xy.map(([x, y]) => x.toFixed(1) + "," + y.toFixed(1)).join(" ");
  s.append(svg("polygon", { points: `0,${h} ${line} ${w},${h}`, fill: color, "fill-opacity": "0.13" }));
  s.append(svg("polyline", { points: line, fill: "none", stroke: color, "stroke-width": "1.4", "stroke-linejoin": "round" }));
  return s;
}

// The hero chart: each limit's 429s per second over ten minutes.
function chart(limits, data) {
  const box = $("chart");
  const w = Math.max(600, box.clientWidth || 1200), h = 150, pad = { l: 44, r: 12, t: 10, b: 22 };
  const lines = limits
    .map((l) => ({ name: l.limit, points: l.rate.limited || [] }))
    .filter((l) => l.points.some((p) => p > 0))
    .sort((a, b) => b.points.reduce((x, y) => x + y, 0) - a.points.reduce((x, y) => x + y, 0));
  const max = Math.max(1, ...lines.flatMap((l) => l.points));
  const top = 4 * niceStep(max / 4);
  const s = svg("svg", { class: "chart", width: w, height: h, viewBox: `0 0 ${w} ${h}`, role: "img", "aria-label": "429 responses per second by limit" });
  const iw = w - pad.l - pad.r, ih = h - pad.t - pad.b;
  for (let i = 0; i <= 4; i++) {
    const y = pad.t + ih - (i / 4) * ih;
    s.append(svg("line", { class: "grid-line", x1: pad.l, x2: w - pad.r, y1: y, y2: y }));
    const t = svg("text", { x: pad.l - 6, y: y + 3.5, "text-anchor": "end" });
    t.textContent = String(+((top * i) / 4).toFixed(2));
    s.append(t);
  }
  const span = data.points * data.step_s;
  [[0, "-" + span / 60 + " min"], [0.5, "-" + span / 120 + " min"], [1, "now"]].forEach(([f, label]) => {
    const t = svg("text", { x: pad.l + f * iw, y: h - 6, "text-anchor": f === 0 ? "start" : f === 1 ? "end" : "middle" });
    t.textContent = label;
    s.append(t);
  });
  const legend = $("legend");
  legend.replaceChildren();
  lines.slice(0, PALETTE.length).forEach((l, i) => {
    const n = l.points.length, step = n > 1 ? iw / (n - 1) : iw;
    const pts = l.points.map((p, j) => (pad.l + j * step).toFixed(1) + "," + (pad.t + ih - (p / top) * ih).toFixed(1)).join(" ");
    s.append(svg("polyline", { points: pts, fill: "none", stroke: PALETTE[i], "stroke-width": "1.6", "stroke-linejoin": "round" }));
    legend.append(el("span", {}, el("i"), l.name + " · " + rate(now(l.points)) + "/s"));
  });
  if (!lines.length) legend.append(el("span", {}, "No 429s in the last 10 minutes."));
  legend.querySelectorAll("i").forEach((i, k) => (i.style.background = PALETTE[k]));
  box.replaceChildren(s);
}

// The smallest of 1, 2, 2.5, 5 times a power of ten at least `v`: gridlines at round numbers.
function niceStep(v) {
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function tile(label, value, sub, cls) {
  return el("div", { class: "tile" }, el("div", { class: "label" }, label), el("div", { class: "value " + (cls || "") }, value), el("div", { class: "sub" }, sub));
}

function tiles(data) {
  const limits = data.limits;
  const limitedNow = limits.reduce((s, l) => s + now(l.rate.limited), 0);
  // As the table's "Limited, 10 min" column: enforced limits only (a dry run's admissions
  // would dilute the share with requests it never refuses).
  const enforced = limits.filter((l) => !l.shadow);
  const limited10 = enforced.reduce((s, l) => s + (l.window.limited || 0), 0);
  const admitted10 = enforced.reduce((s, l) => s + (l.window.admitted || 0), 0);
  const ups = data.upstreams, healthy = ups.filter((u) => u.healthy).length;
  const st = data.limiter;
  const store = st.backend === "local" ? ["In process", "local buckets"] : [st.breaker_open ? "Breaker open" : "Redis", st.mode + (st.breaker_open ? " · failing fast" : " · " + int(st.total?.errors) + " errors")];
  $("tiles").replaceChildren(
    tile("429s per second", rate(limitedNow) + "/s", "all limits, last 10 s"),
    tile("429s, last 10 min", int(limited10), admitted10 + limited10 ? ((100 * limited10) / (admitted10 + limited10)).toFixed(1) + "% of enforced limits' decisions" : "no decisions yet"),
    tile("Limiter store", store[0], store[1]),
    tile("Config", "gen " + int(data.generation), int(data.config.reloads.failed) + " reload failures"),
    tile("Upstream targets", ups.length ? healthy + " / " + ups.length : "none", ups.length ? (ups.length - healthy ? ups.length - healthy + " unhealthy" : "all healthy") : "respond-only routes"),
  );
}

// A cost settled from responses: the reserve, the units settled, and who owes what.
function settledNote(s) {
  const owing = s.owing === undefined ? "" : " · " + int(s.owing) + " owing " + int(s.owed);
  return el("span", { "data-settled": int(s.units) }, " · reserve " + int(s.reserve) + " · " + int(s.units) + " units settled" + owing);
}

function limitsTable(data) {
  const rows = data.limits.map((l) => {
    // A dry run rejects nothing: its "limited" columns show what it would have rejected.
    const lim = l.shadow ? "shadow_limited" : "limited";
    const a = l.rate.admitted || [], r = l.rate[lim] || [];
    const limited = l.window[lim] || 0;
    // A dry run's would-be rejections were admitted too: its share is of all it decided.
    const decided = (l.window.admitted || 0) + (l.shadow ? 0 : limited);
    const share = decided ? (100 * limited) / decided : 0;
    const would = (text) => (l.shadow ? "would limit " + text : text);
    return el("tr", { "data-limit": l.limit, "data-route": l.route },
      el("td", { class: "muted" }, l.route),
      el("td", { class: "name" }, l.limit, l.shadow ? [" ", pill("info", "dry run")] : null),
      el("td", { class: "muted" }, l.rule, l.settled ? settledNote(l.settled) : null),
      el("td", {}, el("div", { class: "rate" }, spark(a, "var(--admitted)"), el("b", {}, rate(now(a))))),
      el("td", {}, el("div", { class: "rate" }, spark(r, "var(--limited)"), el("b", {}, would(rate(now(r)))))),
      el("td", { class: "num", "data-limit": l.limit, "data-count": "admitted" }, int(l.total.admitted)),
      el("td", { class: "num", "data-limit": l.limit, "data-count": "limited" }, would(int(l.total[lim]))),
      el("td", { class: "num" }, decided ? would(share.toFixed(1) + "%") : "—"),
    );
  });
  $("limits").replaceChildren(rows.length
    ? table([["Route"], ["Limit"], ["Rule"], ["Admitted/s", "num"], ["Limited/s", "num"], ["Admitted", "num"], ["Limited", "num"], ["Limited, 10 min", "num"]], rows)
    : empty("No route has a limit."));
}

// The candidate config's decisions on the same traffic (a series of the sampler's).
function candidatePanel(data) {
  const series = (data.series && data.series.candidates) || [];
  const rows = series.map((c) => {
    const a = c.rate.admitted || [], r = c.rate.limited || [];
    const decided = (c.window.admitted || 0) + (c.window.limited || 0);
    const share = decided ? (100 * (c.window.limited || 0)) / decided : 0;
    return el("tr", { "data-candidate-limit": c.limit, "data-route": c.route },
      el("td", { class: "muted" }, c.route),
      el("td", { class: "name" }, c.limit),
      el("td", {}, el("div", { class: "rate" }, spark(a, "var(--admitted)"), el("b", {}, rate(now(a))))),
      el("td", {}, el("div", { class: "rate" }, spark(r, "var(--limited)"), el("b", {}, rate(now(r))))),
      el("td", { class: "num", "data-candidate-limit": c.limit, "data-count": "admitted" }, int(c.window.admitted)),
      el("td", { class: "num", "data-candidate-limit": c.limit, "data-count": "limited" }, int(c.window.limited)),
      el("td", { class: "num" }, decided ? share.toFixed(1) + "%" : "—"),
    );
  });
  $("candidate").replaceChildren(rows.length
    ? table([["Route"], ["Limit"], ["Would admit/s", "num"], ["Would limit/s", "num"], ["Would admit, 10 min", "num"], ["Would limit, 10 min", "num"], ["Share limited", "num"]], rows)
    : empty("No candidate config is loaded, or it has decided nothing yet."));
}

function topLists(data) {
  const w = data.most_limited_window_s;
  $("top-note").textContent = w ? "429s over the last " + duration(w) + " · digest prefixes" : "";
  const lists = data.limits.filter((l) => l.most_limited.length);
  if (!lists.length) return $("top").replaceChildren(empty("No identity was limited in the last 10 minutes."));
  const cells = lists.map((l) => {
    const max = l.most_limited[0].count;
    const rows = l.most_limited.slice(0, 5).map((t) =>
      el("tr", { "data-identity": t.digest.slice(0, 12), "data-limit": l.limit },
        el("td", { class: "mono", title: t.digest }, t.digest.slice(0, 12)),
        el("td", { class: "num" }, (t.error ? "≤ " : "") + int(t.count)),
        el("td", { width: "40%" }, bar(t.count / max)),
      ));
    return el("div", {}, el("h3", {}, l.limit, el("span", {}, " · " + l.route)), table([["Identity"], ["Rejected", "num"], [""]], rows));
  });
  $("top").replaceChildren(el("div", { class: "idlist" }, cells));
}

function bar(f) {
  const i = el("i");
  i.style.width = Math.max(2, Math.round(f * 100)) + "%";
  return el("div", { class: "bar" }, i);
}

// A panel fed by an endpoint that may not exist on this tollgate.
function optionalPanel(id, answer, field, head, row, none) {
  const box = $(id);
  if (answer.missing) return box.replaceChildren(empty("Not available: this tollgate has no such endpoint."));
  if (answer.failed) return box.replaceChildren(empty("Not available (" + answer.failed + ")."));
  const items = answer[field] || [];
  box.replaceChildren(items.length ? table(head, items.map(row)) : empty(none));
}

const list = (v) => (Array.isArray(v) ? (v.length ? v.join(", ") : "all") : v ?? "—");
const left = (x) => (x.ttl_left_s === null || x.ttl_left_s === undefined ? "permanent" : duration(x.ttl_left_s));

function bansPanels(bans, overrides) {
  const ident = (x) => el("td", { class: "mono clip", title: String(x.identity) }, String(x.identity));
  optionalPanel("bans", bans, "bans", [["ID"], ["Identity"], ["Routes"], ["Reason"], ["Left", "num"]], (b) =>
    el("tr", { "data-ban-id": b.id }, el("td", { class: "mono nowrap" }, String(b.id)), ident(b), el("td", {}, list(b.routes)), el("td", { class: "muted" }, b.reason || "—"), el("td", { class: "num" }, left(b))),
    "No bans in force.");
  optionalPanel("overrides", overrides, "overrides", [["ID"], ["Limit"], ["Identity"], ["Numbers"], ["Reason"], ["Left", "num"]], (o) =>
    el("tr", { "data-override-id": o.id }, el("td", { class: "mono nowrap" }, String(o.id)), el("td", { class: "nowrap" }, o.limit), ident(o),
      el("td", { class: "nowrap" }, o.quota ? String(o.quota) : [o.rate ?? "—", o.burst ? ", burst " + o.burst : ""].join("")), el("td", { class: "muted" }, o.reason || "—"), el("td", { class: "num" }, left(o))),
    "No overrides in force.");
}

// Requests refused by operators' bans over ten minutes (a series of the sampler's).
function bansNote(data) {
  const series = (data.series && data.series.operator_bans) || [];
  const n = series.reduce((s, r) => s + (r.window.refused || 0), 0);
  const note = $("bans-note");
  note.textContent = int(n) + (n === 1 ? " request" : " requests") + " refused in 10 min";
  note.setAttribute("data-operator-refused", String(n));
}

function limitBans(data) {
  const rows = data.limits.filter((l) => l.bans).map((l) =>
    el("tr", { "data-ban-limit": l.limit },
      el("td", { class: "name" }, l.limit),
      el("td", { class: "num" }, int(l.bans.total.started)),
      el("td", {}, el("div", { class: "rate" }, spark(l.bans.rate.refused || [], "var(--limited)"), el("b", {}, int(l.bans.total.refused)))),
      el("td", { class: "num" }, int(l.bans.total.lifted)),
    ));
  $("limit-bans").replaceChildren(rows.length ? table([["Limit"], ["Begun", "num"], ["Refused", "num"], ["Lifted", "num"]], rows) : empty("No limit has a ban: section."));
}

function kv(pairs) {
  return el("dl", { class: "kv" }, pairs.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
}

function store(data) {
  const s = data.limiter;
  if (s.backend === "local") return $("store").replaceChildren(kv([["Backend", pill("ok", "in process")], ["Shared across replicas", "no"], ["Buckets held", int(s.buckets)]]));
  if (!s.total) return $("store").replaceChildren(kv([["Backend", "Redis (" + s.mode + ")"], ["State", pill("warn", "no client")]]));
  const errs = s.rate.errors || [];
  const state = s.breaker_open ? pill("bad", "breaker open") : now(errs) > 0 ? pill("warn", "errors") : pill("ok", "answering");
  $("store").replaceChildren(kv([
    ["Backend", "Redis (" + s.mode + ")"],
    ["State", state],
    ["Calls/s", el("span", { class: "rate" }, spark(s.rate.calls || [], "var(--accent)"), el("b", {}, rate(now(s.rate.calls))))],
    ["Errors/s", el("span", { class: "rate" }, spark(errs, "var(--limited)"), el("b", {}, rate(now(errs))))],
    ["Errors, timeouts (total)", int(s.total.errors) + ", " + int(s.total.timeouts)],
    ["Reconnects, failovers", int(s.total.reconnects) + ", " + int(s.total.failovers)],
    ["Fallback buckets held", int(s.buckets)],
  ]));
}

function config(data) {
  const c = data.config;
  const failed10 = c.window.failed || 0;
  $("config").replaceChildren(kv([
    ["Generation", int(c.generation)],
    ["Reloads applied", int(c.reloads.ok)],
    ["Reload failures", c.reloads.failed ? pill(failed10 ? "bad" : "warn", int(c.reloads.failed) + (failed10 ? " (" + failed10 + " in 10 min)" : "")) : pill("ok", "none")],
    ["Sampled for", duration(data.sampled_s)],
  ]));
}

function upstreams(data) {
  const rows = data.upstreams.map((u) =>
    el("tr", {}, el("td", { class: "name" }, u.upstream), el("td", { class: "mono" }, u.target),
      el("td", {}, u.healthy ? pill("ok", "healthy") : pill("bad", "ejected")),
      el("td", { class: "num" }, u.in_flight === null ? "—" : int(u.in_flight)),
      el("td", { class: "num" }, u.cap === null ? "—" : int(u.cap)),
      el("td", { class: "num" }, u.queued === null ? "—" : queue(u))));
  $("upstreams").replaceChildren(rows.length ? table([["Upstream"], ["Target"], ["Health"], ["In flight", "num"], ["Cap", "num"], ["Queued", "num"]], rows) : empty("No upstream: every route answers itself."));
}

function queue(u) {
  const text = int(u.queued) + " / " + int(u.queue_size);
  if (u.queued === 0) return text;
  return pill(u.queued >= u.queue_size ? "bad" : "warn", text);
}

function render(data, bans, overrides) {
  tiles(data);
  $("chart-note").textContent = "steps of " + data.step_s + " s";
  chart(data.limits, data);
  limitsTable(data);
  candidatePanel(data);
  topLists(data);
  bansPanels(bans, overrides);
  bansNote(data);
  limitBans(data);
  store(data);
  config(data);
  upstreams(data);
}

document.title = "tollgate · " + location.host;
takeFragmentToken();
start();
