// torchyard dashboard: plain JS, no libraries, nothing fetched from anywhere but this server.
// Every data call sends `Authorization: Bearer <key>` (the key lives in localStorage); job events
// stream through fetch() + ReadableStream because EventSource cannot send that header.
"use strict";

const KEY_STORAGE = "torchyard.apiKey";
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
const $ = (id) => document.getElementById(id);

const state = {
  key: localStorage.getItem(KEY_STORAGE) || "",
  jobs: [],
  selected: null,        // job id in the job view
  stream: null,          // AbortController of the job view's event stream
  series: null,          // chart data of the selected job
  predictJob: null,      // job id the predict panel uses
};

// ------------------------------------------------------------------ helpers
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "style") node.style.cssText = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node[k] = v;
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}
const pct = (v) => (v === null || v === undefined ? "–" : `${(100 * v).toFixed(1)} %`);
const shortId = (id) => (id ? id.slice(-10) : "–");
function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}
function when(iso) {
  if (!iso) return "–";
  const d = new Date(iso);
  return d.toLocaleString(undefined, { month: "short", day: "numeric", hour: "2-digit", minute: "2-digit", second: "2-digit" });
}

function authHeaders(extra = {}) {
  return state.key ? { ...extra, Authorization: `Bearer ${state.key}` } : { ...extra };
}

class ApiError extends Error {
  constructor(status, detail) { super(detail); this.status = status; }
}

async function api(path, options = {}) {
  let response;
  try {
    response = await fetch(path, { ...options, headers: authHeaders(options.headers || {}) });
  } catch (err) {
    setConnection(false, "the server does not answer");
    throw new ApiError(0, `cannot reach the server: ${err.message}`);
  }
  if (response.status === 401) {
    setConnection(false, "API key needed");
    showBanner("This server needs an API key: enter it at the top right and press Save.");
  } else {
    setConnection(true);
  }
  if (!response.ok) {
    let detail = response.statusText;
    try { detail = (await response.json()).detail || detail; } catch (_) { /* not JSON */ }
    throw new ApiError(response.status, typeof detail === "string" ? detail : JSON.stringify(detail));
  }
  return response;
}
const getJSON = async (path) => (await api(path)).json();

function setConnection(ok, why) {
  const dot = $("conn");
  dot.className = `conn ${ok ? "ok" : "bad"}`;
  dot.title = ok ? "connected" : why || "not connected";
  if (ok) hideBanner();
}
function showBanner(text) { const b = $("banner"); b.textContent = text; b.hidden = false; }
function hideBanner() { $("banner").hidden = true; }

// ------------------------------------------------------------------ devices
async function refreshDevices() {
  let devices;
  try { devices = (await getJSON("/devices")).devices; } catch (_) { return; }
  const box = $("devices");
  box.replaceChildren();
  if (!devices.length) {
    box.append(el("p", { class: "muted" }, "No worker yet: start one with `torchyard worker --device 0` (or cpu)."));
  }
  for (const d of devices) {
    const used = d.memory_used_bytes, total = d.memory_total_bytes;
    const memFrac = used !== null && total ? Math.min(1, used / total) : 0;
    const util = d.utilization_percent;
    box.append(el("div", { class: "device", "data-device": d.id },
      el("div", { class: "dev-head" }, el("span", { class: "dev-name" }, d.name || d.type), el("span", { class: `pill ${d.status}` }, d.status)),
      el("div", { class: "dev-id mono muted", title: d.id }, d.id),
      meter("memory", `${bytes(used)} / ${bytes(total)}`, memFrac, "mem"),
      meter("utilisation", util === null ? "n/a" : `${util.toFixed(0)} %`, util === null ? 0 : util / 100, "util"),
      el("div", { class: "dev-job" },
        d.current_job ? el("span", {}, "training ", el("a", { href: "#", class: "mono", onclick: (e) => { e.preventDefault(); selectJob(d.current_job); } }, shortId(d.current_job)))
          : el("span", { class: "muted" }, "no job"),
        el("span", { class: "muted" }, ` · ${d.loaded_models.length} model${d.loaded_models.length === 1 ? "" : "s"} resident`)),
    ));
  }
  const select = $("device");
  const current = select.value;
  const options = ["auto", "cpu", "cuda", ...devices.filter((d) => d.status !== "offline").map((d) => d.id)];
  if ([...select.options].map((o) => o.value).join("|") !== options.join("|")) {
    select.replaceChildren(...options.map((o) => el("option", { value: o }, o)));
    if (options.includes(current)) select.value = current;
  }
}

function meter(label, text, fraction, kind) {
  return el("div", { class: `meter ${kind}` },
    el("div", { class: "meter-label" }, el("span", {}, label), el("span", {}, text)),
    el("div", { class: "bar" }, el("div", { style: `width:${(100 * fraction).toFixed(1)}%` })));
}

// ------------------------------------------------------------------ jobs table
async function refreshJobs() {
  let jobs;
  try { jobs = (await getJSON("/jobs?limit=50")).jobs; } catch (_) { return; }
  state.jobs = jobs;
  const body = $("jobs-table").tBodies[0];
  body.replaceChildren();
  if (!jobs.length) body.append(el("tr", {}, el("td", { colSpan: 9, class: "muted" }, "no jobs yet: start one above")));
  for (const j of jobs) {
    const epochs = j.params.epochs || j.progress.epochs || 0;
    const frac = j.status === "succeeded" ? 1 : progressFraction(j.progress);
    const last = j.metrics.length ? j.metrics[j.metrics.length - 1] : null;
    body.append(el("tr", { "data-id": j.id, "data-status": j.status, class: j.id === state.selected ? "selected" : "", onclick: () => selectJob(j.id) },
      el("td", { class: "mono", title: j.id }, shortId(j.id)),
      el("td", { class: "small muted" }, j.kind || "train"),
      el("td", {}, j.model), el("td", { title: j.dataset }, j.dataset_name || j.dataset),
      el("td", {}, el("span", { class: `pill ${j.status}`, title: j.error || j.message || "" }, j.status)),
      el("td", {}, el("span", { class: "mini" }, el("div", { style: `width:${(100 * frac).toFixed(0)}%` })), `${j.progress.epoch}/${epochs}`),
      el("td", {}, j.evaluation ? pct(j.evaluation.accuracy) : last ? pct(last.val_accuracy) : "–"),
      el("td", { class: "mono small" }, j.device || j.requested_device),
      el("td", { class: "small muted" }, when(j.created_at))));
  }
  refreshPredictJobs();
  refreshStartFrom();
}

function progressFraction(p) {
  if (!p || !p.epochs) return 0;
  const inEpoch = p.steps ? p.step / p.steps : 0;
  return Math.min(1, (Math.max(0, p.epoch - 1) + inEpoch) / p.epochs);
}

function refreshPredictJobs() {
  const select = $("predict-job");
  const done = state.jobs.filter((j) => j.status === "succeeded" && (j.kind || "train") === "train");
  const values = done.map((j) => j.id);
  if ([...select.options].map((o) => o.value).join("|") !== values.join("|")) {
    const keep = state.predictJob && values.includes(state.predictJob) ? state.predictJob : values[0];
    select.replaceChildren(...done.map((j) => el("option", { value: j.id }, `${j.model} on ${j.dataset_name || j.dataset} · ${shortId(j.id)}`)));
    if (!done.length) select.append(el("option", { value: "" }, "no succeeded job yet"));
    if (keep) select.value = keep;
    state.predictJob = keep || null;
  }
}

// ------------------------------------------------------------------ the job view
async function selectJob(jobId) {
  if (state.stream) state.stream.abort();
  state.selected = jobId;
  for (const row of $("jobs-table").tBodies[0].rows) row.classList.toggle("selected", row.dataset.id === jobId);
  state.series = { loss: { train: [], val: [] }, acc: { train: [], val: [] }, epochs: 0, classes: null };
  $("job-title").textContent = jobId;
  $("per-class").replaceChildren();
  clearEvaluation();
  drawCharts();
  let job;
  try { job = await getJSON(`/jobs/${encodeURIComponent(jobId)}`); } catch (err) { $("job-meta").textContent = err.message; return; }
  state.series.epochs = job.params.epochs || job.progress.epochs || 1;
  renderJob(job);
  const controller = new AbortController();
  state.stream = controller;
  streamEvents(jobId, (event) => onJobEvent(jobId, event), controller.signal)
    .catch((err) => { if (err.name !== "AbortError") $("job-meta").textContent = `event stream: ${err.message}`; });
}

function renderJob(job) {
  const status = $("job-status");
  status.textContent = job.status;
  status.className = `pill ${job.status}`;
  status.dataset.status = job.status;
  $("job-meta").textContent = jobMeta(job);
  $("cancel-job").hidden = TERMINAL.has(job.status);
  $("download-ckpt").hidden = !job.checkpoint;
  $("export-controls").hidden = !(job.kind === "train" && job.status === "succeeded");
  if (job.id !== $("export-status").dataset.job) { $("export-status").textContent = ""; $("export-status").dataset.job = job.id; }
  $("delete-job").hidden = !TERMINAL.has(job.status);
  showPromote(job);
  setProgress(job.progress, job.status);
  for (const m of job.metrics) addMetrics(m);
  drawCharts();
  renderJobEvaluation(job);
}

function setProgress(p, status) {
  const frac = status === "succeeded" ? 1 : progressFraction(p);
  $("job-progress").style.width = `${(100 * frac).toFixed(1)}%`;
  $("job-progress-text").textContent = p && p.epochs
    ? `epoch ${p.epoch}/${p.epochs} · step ${p.step}/${p.steps}${status ? ` · ${status}` : ""}` : status || "";
}

function addMetrics(m) {
  const s = state.series;
  const put = (arr, y) => {
    if (y === null || y === undefined) return;
    const i = arr.findIndex((pt) => pt[0] === m.epoch);
    if (i >= 0) arr[i] = [m.epoch, y]; else arr.push([m.epoch, y]);
    arr.sort((a, b) => a[0] - b[0]);
  };
  put(s.loss.train, m.train_loss); put(s.loss.val, m.val_loss);
  put(s.acc.train, m.train_accuracy); put(s.acc.val, m.val_accuracy);
  if (m.per_class_accuracy) renderPerClass(m.per_class_accuracy);
}

function renderPerClass(perClass) {
  $("per-class").replaceChildren(el("div", { class: "pc-title small muted" }, "Accuracy per class (last epoch)"),
    ...Object.entries(perClass).map(([name, acc]) =>
    el("div", { class: "pc" }, el("span", { class: "pc-name", title: `Accuracy of ${name}` }, name),
      el("span", { class: "bar" }, el("div", { style: `width:${(100 * acc).toFixed(0)}%` })),
      el("span", { class: "small" }, `${(100 * acc).toFixed(0)} %`))));
}

function onJobEvent(jobId, event) {
  if (state.selected !== jobId) return;
  const d = event.data;
  if (event.event === "progress") setProgress(d, "running");
  else if (event.event === "metrics") { addMetrics(d); drawCharts(); }
  else if (event.event === "batch_backoff" || event.event === "early_stop") noteJob(d.message);
  else if (event.event === "status") {
    const status = $("job-status");
    status.textContent = d.status; status.className = `pill ${d.status}`; status.dataset.status = d.status;
    if (TERMINAL.has(d.status)) {
      // the record has the final word (checkpoint, error); refresh the table and the predict list
      getJSON(`/jobs/${encodeURIComponent(jobId)}`).then((job) => {
        if (state.selected !== jobId) return;
        renderJob(job);
        if (job.status === "succeeded") state.predictJob = job.id;
        return refreshJobs().then(() => { if (job.status === "succeeded") $("predict-job").value = job.id; });
      }).catch(() => {});
    }
  }
}

// Server-sent events over fetch: parses the text/event-stream framing and resumes with
// Last-Event-ID when the connection drops, until the job's terminal status.
async function streamEvents(jobId, onEvent, signal) {
  let lastId = null;
  for (let attempt = 0; attempt < 50 && !signal.aborted; attempt += 1) {
    const headers = { Accept: "text/event-stream" };
    if (lastId) headers["Last-Event-ID"] = lastId;
    let ended = false;
    try {
      const response = await api(`/jobs/${encodeURIComponent(jobId)}/events`, { headers, signal });
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value.replace(/\r\n/g, "\n");
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          const event = parseBlock(block);
          if (!event) continue;
          if (event.id) lastId = event.id;
          onEvent(event);
          if (event.event === "status" && TERMINAL.has(event.data.status)) ended = true;
        }
      }
    } catch (err) {
      if (err.name === "AbortError" || (err.status && err.status < 500)) throw err;
    }
    if (ended || signal.aborted) return;
    try {
      const job = await getJSON(`/jobs/${encodeURIComponent(jobId)}`);
      if (TERMINAL.has(job.status)) { onEvent({ event: "status", data: { status: job.status } }); return; }
    } catch (_) { /* retry below */ }
    await new Promise((resolve) => setTimeout(resolve, Math.min(3000, 300 * (attempt + 1))));
  }
}

function parseBlock(block) {
  let id = null, event = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (!line || line.startsWith(":")) continue;
    const i = line.indexOf(":");
    const field = i < 0 ? line : line.slice(0, i);
    let value = i < 0 ? "" : line.slice(i + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "id") id = value;
    else if (field === "event") event = value;
    else if (field === "data") data.push(value);
  }
  if (!data.length) return null;
  let parsed;
  try { parsed = JSON.parse(data.join("\n")); } catch (_) { parsed = { raw: data.join("\n") }; }
  return { id, event, data: parsed };
}

// ------------------------------------------------------------------ charts (canvas, by hand)
const COLORS = { train: "#2f6fde", val: "#ee4c2c" };

function drawCharts() {
  const s = state.series || { loss: { train: [], val: [] }, acc: { train: [], val: [] }, epochs: 1 };
  drawChart($("loss-chart"), s.loss, { epochs: s.epochs, format: (v) => v.toFixed(2) });
  drawChart($("acc-chart"), s.acc, { epochs: s.epochs, min: 0, max: 1, format: (v) => `${Math.round(v * 100)}%` });
}

function drawChart(canvas, series, { epochs, min, max, format }) {
  const dpr = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 480, height = canvas.clientHeight || 220;
  if (canvas.width !== Math.round(width * dpr) || canvas.height !== Math.round(height * dpr)) {
    canvas.width = Math.round(width * dpr); canvas.height = Math.round(height * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const all = [...series.train, ...series.val];
  canvas.dataset.points = String(all.length);
  const pad = { left: 44, right: 12, top: 24, bottom: 28 };
  const w = width - pad.left - pad.right, h = height - pad.top - pad.bottom;
  const ys = all.map((p) => p[1]);
  let lo = min !== undefined ? min : Math.min(...ys, Infinity);
  let hi = max !== undefined ? max : Math.max(...ys, -Infinity);
  if (!isFinite(lo) || !isFinite(hi)) { lo = 0; hi = 1; }
  if (min === undefined) lo = Math.max(0, lo - 0.1 * (hi - lo || 1));
  if (max === undefined) hi = hi + 0.1 * (hi - lo || 1);
  const xMax = Math.max(epochs || 1, ...all.map((p) => p[0]), 1);
  const x = (e) => pad.left + (xMax <= 1 ? w / 2 : ((e - 1) / (xMax - 1)) * w);
  const y = (v) => pad.top + h - ((v - lo) / (hi - lo || 1)) * h;

  ctx.font = "11px system-ui, sans-serif";
  ctx.lineWidth = 1;
  ctx.strokeStyle = "#e8ebf1"; ctx.fillStyle = "#6b7487";
  ctx.textAlign = "right"; ctx.textBaseline = "middle";
  for (let i = 0; i <= 4; i += 1) {
    const v = lo + ((hi - lo) * i) / 4;
    ctx.beginPath(); ctx.moveTo(pad.left, y(v)); ctx.lineTo(pad.left + w, y(v)); ctx.stroke();
    ctx.fillText(format(v), pad.left - 6, y(v));
  }
  ctx.textAlign = "center"; ctx.textBaseline = "top";
  const step = Math.max(1, Math.ceil(xMax / 10));
  for (let e = 1; e <= xMax; e += step) ctx.fillText(String(e), x(e), pad.top + h + 6);
  ctx.fillText("epoch", pad.left + w / 2, pad.top + h + 16 > height - 12 ? height - 12 : pad.top + h + 16);

  if (!all.length) {
    ctx.fillStyle = "#9aa3b5"; ctx.textBaseline = "middle";
    ctx.fillText("waiting for the first epoch…", pad.left + w / 2, pad.top + h / 2);
  }
  for (const [name, points] of Object.entries(series)) {
    if (!points.length) continue;
    ctx.strokeStyle = COLORS[name]; ctx.fillStyle = COLORS[name]; ctx.lineWidth = 2;
    ctx.beginPath();
    points.forEach(([e, v], i) => (i ? ctx.lineTo(x(e), y(v)) : ctx.moveTo(x(e), y(v))));
    ctx.stroke();
    for (const [e, v] of points) { ctx.beginPath(); ctx.arc(x(e), y(v), 3, 0, 2 * Math.PI); ctx.fill(); }
  }
  // legend
  ctx.textAlign = "left"; ctx.textBaseline = "middle"; ctx.lineWidth = 2;
  let lx = pad.left + w - 110;
  for (const name of ["train", "val"]) {
    ctx.strokeStyle = COLORS[name]; ctx.fillStyle = "#4a5366";
    ctx.beginPath(); ctx.moveTo(lx, 9); ctx.lineTo(lx + 16, 9); ctx.stroke();
    ctx.fillText(name, lx + 20, 9);
    lx += 56;
  }
}

// ------------------------------------------------------------------ start a job
async function loadChoices() {
  try {
    const [models, datasets] = await Promise.all([getJSON("/models"), getJSON("/datasets")]);
    const keepModel = $("model").value, keepData = $("dataset").value;
    $("model").replaceChildren(...models.models.map((m) => el("option", { value: m.name, title: m.description }, m.name)));
    $("dataset").replaceChildren(...datasets.datasets.map((d) =>
      el("option", { value: d.id, disabled: d.available === false }, d.name && d.name !== d.id ? `${d.name} (${d.id})` : d.id)));
    if (keepModel) $("model").value = keepModel;
    if (keepData) $("dataset").value = keepData;
    else if (datasets.datasets.some((d) => d.id === "fake")) $("dataset").value = "fake";
    fillEvaluateDatasets(datasets.datasets);
  } catch (_) { /* the banner says why */ }
}

async function startJob(event) {
  event.preventDefault();
  const error = $("job-form-error");
  error.hidden = true;
  const button = $("start-job");
  button.disabled = true;
  try {
    const body = { model: $("model").value, dataset: $("dataset").value, epochs: Number($("epochs").value), device: $("device").value };
    const from = $("start-from").value;
    if (from === "pretrained") body.pretrained = true;
    else if (from) body.init_from = from;
    const job = await (await api("/jobs", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) })).json();
    await refreshJobs();
    selectJob(job.id);
  } catch (err) {
    error.textContent = err.message; error.hidden = false;
  } finally {
    button.disabled = false;
  }
}

async function cancelSelected() {
  if (!state.selected) return;
  try { await api(`/jobs/${encodeURIComponent(state.selected)}/cancel`, { method: "POST" }); refreshJobs(); }
  catch (err) { $("job-meta").textContent = err.message; }
}

function saveResponse(response, fallbackName) {
  return response.blob().then((blob) => {
    const url = URL.createObjectURL(blob);
    const name = (response.headers.get("Content-Disposition") || "").match(/filename="?([^";]+)"?/);
    el("a", { href: url, download: name ? name[1] : fallbackName }).click();
    setTimeout(() => URL.revokeObjectURL(url), 10000);
  });
}

async function downloadCheckpoint() {
  if (!state.selected) return;
  try {
    const response = await api(`/jobs/${encodeURIComponent(state.selected)}/checkpoint`);
    await saveResponse(response, `${state.selected}.pt`);
  } catch (err) { $("job-meta").textContent = err.message; }
}

// An export is built by an export job on a worker: GET answers 202 (with Retry-After) until the
// file is ready, then the file. The button waits as the API asks, while this job stays selected.
async function exportSelected() {
  const jobId = state.selected;
  const format = $("export-format").value;
  const button = $("export-job");
  if (!jobId || button.disabled) return;
  button.disabled = true;
  const label = $("export-format").selectedOptions[0].textContent;
  try {
    for (;;) {
      const response = await api(`/jobs/${encodeURIComponent(jobId)}/export?format=${encodeURIComponent(format)}`);
      if (state.selected !== jobId) return;
      if (response.status === 200) {
        $("export-status").textContent = `${label} export downloaded`;
        await saveResponse(response, `${jobId}.${format === "onnx" ? "onnx" : "torchscript.pt"}`);
        return;
      }
      const exportJob = await response.json();
      $("export-status").textContent = `building the ${label} export (job ${exportJob.id}, ${exportJob.status})…`;
      const wait = Math.min(5, Math.max(0.5, Number(response.headers.get("Retry-After")) || 1));
      await new Promise((resolve) => setTimeout(resolve, wait * 1000));
      if (state.selected !== jobId) return;
    }
  } catch (err) {
    if (state.selected === jobId) { $("export-status").textContent = ""; noteJob(err.message); }
  } finally {
    button.disabled = false;
  }
}

// DELETE /jobs/{id}: the job's record, events and files (and a training job's exports). The API
// refuses (409) what must stay, e.g. a job an alias points at; its reason is shown as it is.
async function deleteSelected() {
  const jobId = state.selected;
  if (!jobId || !confirm(`Delete job ${jobId} with its events and files? This cannot be undone.`)) return;
  try {
    await api(`/jobs/${encodeURIComponent(jobId)}`, { method: "DELETE" });
  } catch (err) {
    noteJob(err.message);
    return;
  }
  if (state.stream) state.stream.abort();
  state.selected = null;
  $("job-title").textContent = "— pick one from the list";
  $("job-status").textContent = "";
  $("job-status").className = "pill";
  for (const id of ["cancel-job", "download-ckpt", "export-controls", "delete-job", "promote-form"]) $(id).hidden = true;
  $("job-meta").textContent = `job ${jobId} deleted`;
  refreshJobs();
}

// ------------------------------------------------------------------ predict
async function predictFile(file) {
  const error = $("predict-error");
  error.hidden = true;
  const results = $("predict-results");
  const jobId = $("predict-job").value;
  const preview = $("predict-preview");
  preview.src = URL.createObjectURL(file); preview.hidden = false;
  if (!jobId) { error.textContent = "No succeeded job to predict with yet: train one first."; error.hidden = false; return; }
  results.replaceChildren(el("p", { class: "muted" }, "classifying…"));
  const form = new FormData();
  form.append("job_id", jobId);
  form.append("top_k", "5");
  form.append("file", file, file.name);
  try {
    const answer = await (await api("/predict", { method: "POST", body: form })).json();
    const preds = answer.results[0].predictions;
    results.replaceChildren(
      el("p", { class: "small muted" }, `${file.name} · ${answer.model} on ${answer.device}`),
      ...preds.map((p, i) => el("div", { class: i ? "pred-row" : "pred-row top", "data-label": p.label },
        el("span", { class: "pred-label", title: p.label }, p.label),
        el("span", { class: "pred-bar" }, el("div", { style: `width:${(100 * p.probability).toFixed(1)}%` })),
        el("span", { class: "pred-pct" }, `${(100 * p.probability).toFixed(1)} %`))));
  } catch (err) {
    results.replaceChildren();
    error.textContent = err.message; error.hidden = false;
  }
}

function wirePredict() {
  const zone = $("drop-zone");
  $("predict-file").addEventListener("change", (e) => { if (e.target.files[0]) predictFile(e.target.files[0]); });
  $("predict-job").addEventListener("change", (e) => { state.predictJob = e.target.value; });
  zone.addEventListener("dragover", (e) => { e.preventDefault(); zone.classList.add("over"); });
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", (e) => {
    e.preventDefault(); zone.classList.remove("over");
    const file = e.dataTransfer.files[0];
    if (file) predictFile(file);
  });
  zone.addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") $("predict-file").click(); });
}

// ------------------------------------------------------------------ aliases
// Stable names clients predict with (`alias` instead of `job_id`); a succeeded training job is
// promoted from its view, and the server loads it where the old target is resident before moving.
async function refreshAliases() {
  let aliases;
  try { aliases = (await getJSON("/aliases")).aliases; } catch (_) { return; }
  const body = $("aliases-table").tBodies[0];
  body.replaceChildren();
  if (!aliases.length) body.append(el("tr", {}, el("td", { colSpan: 7, class: "muted" }, "no aliases yet: promote a succeeded job")));
  for (const a of aliases) {
    body.append(el("tr", { "data-alias": a.name, "data-job": a.job_id },
      el("td", { class: "mono" }, a.name),
      el("td", { class: "mono", title: a.job_id }, el("a", { href: "#", onclick: (e) => { e.preventDefault(); selectJob(a.job_id); } }, shortId(a.job_id))),
      el("td", {}, a.model),
      el("td", { class: "mono small", title: a.previous_job_id || "" }, shortId(a.previous_job_id)),
      el("td", { class: "small muted" }, when(a.updated_at)),
      el("td", { class: "small muted", title: a.note || "" }, a.updated_by || "–"),
      el("td", {}, a.previous_job_id ? el("button", { type: "button", class: "small", onclick: () => rollbackAlias(a.name) }, "Roll back") : "")));
  }
}

function showPromote(job) {
  const form = $("promote-form");
  form.hidden = !(job.status === "succeeded" && (job.kind || "train") === "train");
  form.dataset.job = job.id;
}

async function promoteSelected(event) {
  event.preventDefault();
  const name = $("promote-name").value.trim();
  const jobId = $("promote-form").dataset.job;
  if (!name || !jobId) return;
  const error = $("alias-error");
  error.hidden = true;
  try {
    const alias = await (await api(`/aliases/${encodeURIComponent(name)}`, { method: "PUT", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ job_id: jobId, note: "promoted from the dashboard" }) })).json();
    const warmed = alias.warm.map((w) => `${w.device}: ${w.status}`).join(", ");
    $("job-meta").textContent = `alias ${alias.name} → ${alias.job_id}${warmed ? ` (warmed ${warmed})` : ""}`;
    await refreshAliases();
  } catch (err) { error.textContent = err.message; error.hidden = false; }
}

async function rollbackAlias(name) {
  const error = $("alias-error");
  error.hidden = true;
  try {
    await api(`/aliases/${encodeURIComponent(name)}/rollback`, { method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ note: "rolled back from the dashboard" }) });
    await refreshAliases();
  } catch (err) { error.textContent = err.message; error.hidden = false; }
}

// ------------------------------------------------------------------ recipe, evaluations
function jobMeta(job) {
  const p = job.params;
  const parts = [`${job.model} on ${job.dataset_name || job.dataset}`, job.device ? `on ${job.device}` : `device ${job.requested_device}`];
  if ((job.kind || "train") === "train") {
    parts.push(`${p.epochs} epochs`, `batch ${p.batch_size}`, `${p.optimizer} lr ${p.learning_rate}` + (p.schedule ? ` ${p.schedule}` : ""));
    if (p.init_from) parts.push(`from job ${shortId(p.init_from)}`);
    if (p.pretrained) parts.push("from ImageNet weights");
    if (job.best_epoch) parts.push(`weights of epoch ${job.best_epoch}`);
    if (job.stop_reason) parts.push(job.stop_reason);
  } else if (job.kind === "predict") {
    parts.push(`labels ${p.images ?? "?"} images with job ${shortId(p.trained_job)}` + (p.alias ? ` (alias ${p.alias})` : ""), `top ${p.top_k}`);
    if (job.progress && job.progress.images_per_second) parts.push(`${Math.round(job.progress.images_per_second)} images/s`);
    if (job.results) parts.push(`${job.results.errors} unreadable · results: ${job.results.url}`);
  } else if (p.trained_job) {
    parts.push(`evaluates job ${shortId(p.trained_job)}`);
  }
  parts.push(job.error ? `error: ${job.error}` : job.message || "");
  return parts.filter(Boolean).join(" · ");
}

function noteJob(message) {
  if (message) $("job-meta").textContent = `${$("job-meta").textContent.split(" · ⚠")[0]} · ⚠ ${message}`;
}

function refreshStartFrom() {
  const select = $("start-from");
  const jobs = state.jobs.filter((j) => j.status === "succeeded" && (j.kind || "train") === "train");
  const values = ["", "pretrained", ...jobs.map((j) => j.id)];
  if ([...select.options].map((o) => o.value).join("|") === values.join("|")) return;
  const keep = select.value;
  select.replaceChildren(el("option", { value: "" }, "scratch"), el("option", { value: "pretrained" }, "ImageNet weights (pretrained)"),
    ...jobs.map((j) => el("option", { value: j.id }, `job ${shortId(j.id)}: ${j.model} on ${j.dataset_name || j.dataset}`)));
  if (values.includes(keep)) select.value = keep;
}

function fillEvaluateDatasets(datasets) {
  const select = $("evaluate-dataset");
  const keep = select.value;
  select.replaceChildren(...datasets.map((d) =>
    el("option", { value: d.id, disabled: d.available === false }, d.name && d.name !== d.id ? `${d.name} (${d.id})` : d.id)));
  if (keep) select.value = keep;
}

function clearEvaluation() {
  $("evaluation-view").hidden = true;
  $("evaluations-panel").hidden = true;
  $("confusion").replaceChildren();
  $("eval-bars").replaceChildren();
  $("evaluations").tBodies[0].replaceChildren();
  $("evaluate-error").hidden = true;
}

// A training job shows its kept weights' validation and its evaluations (and a form for another);
// an evaluation job shows its result.
function renderJobEvaluation(job) {
  const isTrain = (job.kind || "train") === "train";
  if (job.evaluation) {
    const r = job.evaluation;
    const what = r.split === "validation" ? `validation split, weights of epoch ${r.epoch}` : r.split === "test" ? "test split" : "all images";
    renderEvaluation(r, `${isTrain ? "Kept weights" : "Evaluation"} on ${job.dataset_name || r.dataset} (${what}): accuracy ${pct(r.accuracy)}, loss ${r.loss.toFixed(4)}, ${r.num_images} images`);
  } else {
    $("evaluation-view").hidden = true;
  }
  $("evaluations-panel").hidden = !(isTrain && job.status === "succeeded");
  if (isTrain) renderEvaluations(job.id, job.evaluations || []);
}

function renderEvaluation(result, title) {
  $("evaluation-title").textContent = title;
  $("eval-bars").replaceChildren(el("div", { class: "pc-title small muted" }, "Accuracy per class"),
    ...Object.entries(result.per_class_accuracy).map(([name, acc]) =>
      el("div", { class: "pc", "data-class": name }, el("span", { class: "pc-name", title: `Accuracy of ${name}` }, name),
        el("span", { class: "bar" }, el("div", { style: `width:${(100 * acc).toFixed(0)}%` })),
        el("span", { class: "small" }, `${(100 * acc).toFixed(0)} %`))));
  drawConfusion($("confusion"), result.classes, result.confusion_matrix);
  $("evaluation-view").hidden = false;
}

// The confusion matrix as a heat-map table: rows are the true classes, columns the predicted ones;
// a cell's shade is its share of its row, so a dark diagonal is a good model.
function drawConfusion(table, classes, matrix) {
  table.replaceChildren();
  if (!matrix) {
    table.append(el("caption", {}, "too many classes to draw the confusion matrix"));
    return;
  }
  table.append(el("caption", {}, "rows: true class · columns: predicted class · shade: share of the row"));
  table.append(el("thead", {}, el("tr", {}, el("th", {}, "true \\ predicted"),
    ...classes.map((name, k) => el("th", { title: name }, String(k))))));
  const body = el("tbody");
  matrix.forEach((row, i) => {
    const total = row.reduce((a, b) => a + b, 0) || 1;
    body.append(el("tr", {}, el("th", { class: "row", title: classes[i] }, `${i} ${classes[i]}`),
      ...row.map((count, j) => {
        const share = count / total;
        const hue = i === j ? "47,111,222" : "238,76,44";
        return el("td", { class: i === j ? "diag" : "", title: `true ${classes[i]}, predicted ${classes[j]}: ${count}`,
          "data-count": String(count),
          style: `background: rgba(${hue},${(0.08 + 0.85 * share).toFixed(3)}); color: ${share > 0.55 ? "#fff" : "#1c2333"}` },
        count ? String(count) : "");
      })));
  });
  table.append(body);
}

function renderEvaluations(jobId, evaluations) {
  const body = $("evaluations").tBodies[0];
  body.replaceChildren();
  if (!evaluations.length) body.append(el("tr", {}, el("td", { colSpan: 6, class: "muted" }, "no evaluations yet")));
  for (const e of evaluations) {
    const r = e.result;
    body.append(el("tr", { "data-id": e.id, "data-status": e.status, onclick: () => {
      if (r) renderEvaluation(r, `Evaluation ${shortId(e.id)} on ${e.dataset_name || e.dataset}: accuracy ${pct(r.accuracy)}, loss ${r.loss.toFixed(4)}, ${r.num_images} images`);
    } },
    el("td", { class: "mono", title: e.id }, shortId(e.id)), el("td", { title: e.dataset }, e.dataset_name || e.dataset),
    el("td", {}, el("span", { class: `pill ${e.status}`, title: e.error || "" }, e.status)),
    el("td", {}, r ? String(r.num_images) : "–"), el("td", {}, r ? pct(r.accuracy) : "–"), el("td", {}, r ? r.loss.toFixed(4) : "–")));
  }
}

async function startEvaluation(event) {
  event.preventDefault();
  const jobId = state.selected;
  const error = $("evaluate-error");
  error.hidden = true;
  if (!jobId) return;
  try {
    const body = { dataset: $("evaluate-dataset").value };
    const created = await (await api(`/jobs/${encodeURIComponent(jobId)}/evaluate`, { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) })).json();
    for (let i = 0; i < 600 && state.selected === jobId; i += 1) {
      const job = await getJSON(`/jobs/${encodeURIComponent(jobId)}`);
      if (state.selected !== jobId) return;
      renderEvaluations(jobId, job.evaluations || []);
      const mine = (job.evaluations || []).find((e) => e.id === created.id);
      if (mine && TERMINAL.has(mine.status)) {
        if (mine.result) renderEvaluation(mine.result, `Evaluation ${shortId(mine.id)} on ${mine.dataset_name || mine.dataset}: accuracy ${pct(mine.result.accuracy)}, loss ${mine.result.loss.toFixed(4)}, ${mine.result.num_images} images`);
        else if (mine.error) { error.textContent = mine.error; error.hidden = false; }
        return;
      }
      await new Promise((resolve) => setTimeout(resolve, 700));
    }
  } catch (err) {
    error.textContent = err.message; error.hidden = false;
  }
}

// ------------------------------------------------------------------ start-up
function wire() {
  $("api-key").value = state.key;
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    state.key = $("api-key").value.trim();
    if (state.key) localStorage.setItem(KEY_STORAGE, state.key); else localStorage.removeItem(KEY_STORAGE);
    refreshAll();
    if (state.selected) selectJob(state.selected);
  });
  $("job-form").addEventListener("submit", startJob);
  $("cancel-job").addEventListener("click", cancelSelected);
  $("download-ckpt").addEventListener("click", downloadCheckpoint);
  $("export-job").addEventListener("click", exportSelected);
  $("delete-job").addEventListener("click", deleteSelected);
  $("promote-form").addEventListener("submit", promoteSelected);
  $("evaluate-form").addEventListener("submit", startEvaluation);
  $("footer-url").textContent = location.origin;
  window.addEventListener("resize", drawCharts);
  wirePredict();
}

async function refreshAll() {
  await Promise.all([loadChoices(), refreshDevices(), refreshJobs(), refreshAliases()]);
}

wire();
drawCharts();
refreshAll();
setInterval(refreshDevices, 2000);
setInterval(refreshJobs, 3000);
setInterval(refreshAliases, 5000);
