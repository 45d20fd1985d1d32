// Sweeps: the list, and a sweep's view at #/sweeps/<id>: its trials (a table sorted by any column),
// the best-so-far curve, a parallel-coordinates plot of each trial's params against the metric, and
// "promote best" (PUT /aliases/{name} with the best trial's job). Drawn on canvases by hand.
import { getJSON, sendJSON } from "./api.js";
import { $, el, jobLink, shortId, when } from "./dom.js";

const view = { id: null, sweep: null, sortKey: "number", sortDesc: false, timer: null };
const STATE_COLORS = { complete: "#2f6fde", pruned: "#b0b7c6", failed: "#ee4c2c", running: "#1e9e63" };

export const selectedSweep = () => view.id;

export async function refreshSweeps() {
  let sweeps;
  try { sweeps = (await getJSON("/sweeps?limit=20")).sweeps; } catch (_) { return; }
  const body = $("sweeps-table").tBodies[0];
  body.replaceChildren();
  if (!sweeps.length) body.append(el("tr", {}, el("td", { colSpan: 6, class: "muted" }, "no sweeps yet: POST /sweeps or `torchyard sweep`")));
  for (const s of sweeps) {
    body.append(el("tr", { "data-sweep": s.id },
      el("td", {}, el("a", { href: `#/sweeps/${encodeURIComponent(s.id)}`, class: "mono", title: s.id }, shortId(s.id))),
      el("td", {}, s.status),
      el("td", {}, `${s.trials.length}/${s.spec.trials}`),
      el("td", {}, s.spec.metric),
      el("td", {}, s.best ? fmt(s.best.value) : "–"),
      el("td", { class: "small muted" }, when(s.created_at))));
  }
}

export function openSweep(sweepId) {
  clearTimeout(view.timer);
  view.id = sweepId;
  view.sweep = null;
  $("sweep-view").hidden = !sweepId;
  if (sweepId) load();
}

async function load() {
  const id = view.id;
  try {
    const sweep = await getJSON(`/sweeps/${encodeURIComponent(id)}`);
    if (id !== view.id) return;
    view.sweep = sweep;
    render();
    const live = sweep.status === "running" || sweep.trials.some((t) => t.state === "running");
    if (live) view.timer = setTimeout(load, 2000);
  } catch (err) {
    $("sweep-meta").textContent = err.message;
    if (id === view.id) view.timer = setTimeout(load, 5000);
  }
}

function render() {
  const s = view.sweep;
  $("sweep-title").textContent = s.id;
  $("sweep-status").textContent = s.status;
  const importance = s.importances ? " · importance: " + Object.entries(s.importances).map(([k, v]) => `${k} ${v.toFixed(2)}`).join(", ") : "";
  $("sweep-meta").textContent = `${s.trials.length}/${s.spec.trials} trials, ${s.parallel} at once · ${s.spec.sampler} sampler, ${s.spec.pruner} pruner · ${direction(s)} ${s.spec.metric}${importance}`;
  $("sweep-best").replaceChildren(s.best ? el("span", {}, `best ${s.spec.metric} ${fmt(s.best.value)}: trial ${s.best.number}, job `, jobLink(s.best.job_id)) : "no complete trial yet");
  $("sweep-promote").hidden = !s.best;
  renderTable(s);
  drawBestSoFar($("sweep-best-chart"), s);
  drawParallel($("sweep-parallel"), s);
}

function renderTable(s) {
  const names = Object.keys(s.spec.space);
  const columns = ["number", "state", "epoch", "value", ...names.map((n) => `params.${n}`), "job_id"];
  const head = $("sweep-trials").tHead;
  head.replaceChildren(el("tr", {}, columns.map((c) => el("th", {
    class: "sortable", "data-key": c, onclick: () => sortBy(c),
  }, (c === "value" ? s.spec.metric : c.replace("params.", "")) + (view.sortKey === c ? (view.sortDesc ? " ▾" : " ▴") : "")))));
  const pick = (t, key) => (key.startsWith("params.") ? t.params[key.slice(7)] : t[key]);
  const rows = [...s.trials].sort((a, b) => {
    const x = pick(a, view.sortKey), y = pick(b, view.sortKey);
    const order = x === y ? 0 : x === null || x === undefined ? 1 : y === null || y === undefined ? -1 : x < y ? -1 : 1;
    return view.sortDesc ? -order : order;
  });
  $("sweep-trials").tBodies[0].replaceChildren(...rows.map((t) => el("tr", { "data-trial": t.number },
    el("td", {}, String(t.number)), el("td", { title: t.error || "" }, t.state), el("td", {}, String(t.epoch)),
    el("td", {}, fmt(t.value)), names.map((n) => el("td", {}, fmt(t.params[n]))),
    el("td", {}, t.job_id ? jobLink(t.job_id) : "–"))));
}

function sortBy(key) {
  view.sortDesc = view.sortKey === key ? !view.sortDesc : false;
  view.sortKey = key;
  if (view.sweep) renderTable(view.sweep);
}

const direction = (s) => s.spec.direction || (s.spec.metric.endsWith("accuracy") ? "maximize" : "minimize");
const fmt = (v) => (v === null || v === undefined ? "–" : typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toPrecision(4)) : String(v));

function canvas2d(canvas) {
  const dpr = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 480, height = canvas.clientHeight || 220;
  canvas.width = Math.round(width * dpr); canvas.height = Math.round(height * dpr);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, width, height);
  ctx.font = "11px system-ui, sans-serif";
  return { ctx, width, height };
}

// The best complete value after each trial, in trial order: a step line over the trials' own points.
function drawBestSoFar(canvas, s) {
  const { ctx, width, height } = canvas2d(canvas);
  const pad = { left: 48, right: 12, top: 14, bottom: 26 };
  const w = width - pad.left - pad.right, h = height - pad.top - pad.bottom;
  const scored = s.trials.filter((t) => t.value !== null && t.value !== undefined);
  const maximize = direction(s) === "maximize";
  const best = [];
  let b = null;
  for (const t of [...s.trials].sort((x, y) => x.number - y.number)) {
    if (t.state === "complete" && t.value !== null) b = b === null ? t.value : maximize ? Math.max(b, t.value) : Math.min(b, t.value);
    if (b !== null) best.push([t.number, b]);
  }
  canvas.dataset.points = String(best.length);
  const ys = scored.map((t) => t.value);
  let lo = Math.min(...ys, Infinity), hi = Math.max(...ys, -Infinity);
  if (!isFinite(lo)) { lo = 0; hi = 1; }
  if (hi === lo) { hi += 0.5; lo -= 0.5; }
  const n = Math.max(s.spec.trials, 2);
  const x = (i) => pad.left + (i / (n - 1)) * w;
  const y = (v) => pad.top + h - ((v - lo) / (hi - lo)) * h;
  ctx.fillStyle = "#6b7487"; ctx.textAlign = "right"; ctx.textBaseline = "middle";
  for (let i = 0; i <= 3; i += 1) { const v = lo + ((hi - lo) * i) / 3; ctx.fillText(fmt(v), pad.left - 6, y(v)); }
  ctx.textAlign = "center"; ctx.textBaseline = "top"; ctx.fillText("trial", pad.left + w / 2, height - 12);
  for (const t of scored) {
    ctx.fillStyle = STATE_COLORS[t.state] || "#999";
    ctx.beginPath(); ctx.arc(x(t.number), y(t.value), 3, 0, 2 * Math.PI); ctx.fill();
  }
  if (best.length) {
    ctx.strokeStyle = "#ee4c2c"; ctx.lineWidth = 2; ctx.beginPath();
    best.forEach(([i, v], k) => { if (k) { ctx.lineTo(x(i), y(best[k - 1][1])); ctx.lineTo(x(i), y(v)); } else ctx.moveTo(x(i), y(v)); });
    ctx.stroke();
  }
}

// One vertical axis per searched param and one for the metric; each trial a line across them.
function drawParallel(canvas, s) {
  const { ctx, width, height } = canvas2d(canvas);
  const names = [...Object.keys(s.spec.space), "value"];
  const pad = { left: 30, right: 30, top: 22, bottom: 16 };
  const w = width - pad.left - pad.right, h = height - pad.top - pad.bottom;
  const ax = (i) => pad.left + (names.length === 1 ? w / 2 : (i / (names.length - 1)) * w);
  const scales = names.map((name) => {
    const range = s.spec.space[name];
    const values = s.trials.map((t) => (name === "value" ? t.value : t.params[name])).filter((v) => v !== null && v !== undefined);
    if (range && range.type === "categorical") {
      const choices = range.choices.map(String);
      return (v) => (choices.length === 1 ? 0.5 : choices.indexOf(String(v)) / (choices.length - 1));
    }
    const log = range && range.log;
    const f = (v) => (log ? Math.log(v) : v);
    const lo = range ? f(range.low) : Math.min(...values), hi = range ? f(range.high) : Math.max(...values);
    return (v) => (hi === lo ? 0.5 : (f(v) - lo) / (hi - lo));
  });
  ctx.strokeStyle = "#c9cfdb"; ctx.fillStyle = "#4a5366"; ctx.textAlign = "center"; ctx.textBaseline = "bottom";
  names.forEach((name, i) => {
    ctx.lineWidth = 1; ctx.beginPath(); ctx.moveTo(ax(i), pad.top); ctx.lineTo(ax(i), pad.top + h); ctx.stroke();
    ctx.fillText(name === "value" ? s.spec.metric : name, ax(i), pad.top - 6);
  });
  let drawn = 0;
  for (const t of s.trials) {
    const points = names.map((name, i) => {
      const v = name === "value" ? t.value : t.params[name];
      return v === null || v === undefined ? null : [ax(i), pad.top + h - scales[i](v) * h];
    });
    ctx.strokeStyle = STATE_COLORS[t.state] || "#999"; ctx.lineWidth = s.best && s.best.number === t.number ? 3 : 1.5;
    ctx.beginPath();
    let started = false;
    for (const p of points) { if (!p) continue; if (started) ctx.lineTo(p[0], p[1]); else { ctx.moveTo(p[0], p[1]); started = true; } }
    ctx.stroke();
    drawn += started ? 1 : 0;
  }
  canvas.dataset.lines = String(drawn);
}

async function promoteBest(event) {
  event.preventDefault();
  const s = view.sweep, name = $("sweep-promote-name").value.trim();
  if (!s || !s.best || !name) return;
  const error = $("sweep-error");
  error.hidden = true;
  try {
    const alias = await (await sendJSON(`/aliases/${encodeURIComponent(name)}`, "PUT",
      { job_id: s.best.job_id, note: `best trial of sweep ${s.id}` })).json();
    $("sweep-best").append(el("span", { class: "muted" }, ` · alias ${alias.name} → ${shortId(alias.job_id)}`));
  } catch (err) { error.textContent = err.message; error.hidden = false; }
}

export function wireSweepView() {
  $("sweep-promote").addEventListener("submit", promoteBest);
}
