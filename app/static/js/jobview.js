// The job view (#/jobs/<id>): what fits the job's kind. A training job: its progress, loss and
// accuracy curves drawn live, per-class accuracy, the kept weights' validation, its evaluations
// and the actions of a trained model (weights, export, promote). An evaluation: its result. A
// predict job: images done and its results file. An export: its format, source and file.
import { api, getJSON, retriable, saveResponse, sendJSON } from "./api.js";
import { addMetrics, drawCharts, emptySeries } from "./charts.js";
import { $, el, formatName, jobHref, kindOf, show, shortId, sleep, TERMINAL } from "./dom.js";
import { clearEvaluation, fitEvaluateDatasets, renderEvaluation, renderEvaluations, resultTitle, startEvaluation } from "./evaluations.js";
import { describe, gangLine, gangOf, kindLabel, progressOf } from "./kinds.js";
import { followEvents } from "./stream.js";

const CONTROLS = ["cancel-job", "download-ckpt", "export-controls", "promote-form", "download-results", "download-export", "delete-job"];
const view = { id: null, job: null, stream: null, series: null };
let onChange = () => {};  // the jobs table and the predict list refresh when a job ends or goes

export const selectedJob = () => view.id;
export function onJobChanged(callback) { onChange = callback; }

export async function openJob(jobId) {
  if (view.stream) view.stream.abort();
  Object.assign(view, { id: jobId, job: null, stream: null, series: emptySeries() });
  for (const row of $("jobs-table").tBodies[0].rows) row.classList.toggle("selected", row.dataset.id === jobId);
  $("job-view").dataset.kind = "";
  $("job-title").textContent = jobId || "— pick one from the list";
  for (const id of ["job-kind", "job-status"]) { $(id).textContent = ""; $(id).className = "pill"; }
  delete $("job-status").dataset.status;
  for (const id of [...CONTROLS, "train-view", "predict-view", "export-view", "job-progress-box", "stream-note", "job-gang"]) show(id, false);
  $("per-class").replaceChildren();
  $("job-meta").replaceChildren();
  $("export-status").textContent = "";
  clearEvaluation();
  if (!jobId) return;
  let job;
  try { job = await getJSON(`/jobs/${encodeURIComponent(jobId)}`); } catch (err) { $("job-meta").textContent = err.message; return; }
  if (view.id !== jobId) return;
  view.series.epochs = job.params.epochs || job.progress.epochs || 1;
  renderJob(job);
  if (TERMINAL.has(job.status)) return;  // its record is final: nothing to stream
  const controller = new AbortController();
  view.stream = controller;
  followEvents(jobId, { onEvent: (event) => onJobEvent(jobId, event), onWait: streamNote, signal: controller.signal })
    .catch((err) => { if (err.name !== "AbortError" && view.id === jobId) note(`event stream: ${err.message}`); });
}

function renderJob(job) {
  view.job = job;
  const kind = kindOf(job), done = job.status === "succeeded";
  $("job-view").dataset.kind = kind;
  $("job-kind").textContent = kindLabel(job);
  $("job-kind").className = "pill kind";
  setStatus(job.status);
  $("job-meta").replaceChildren(...describe(job).flatMap((part, i) => (i ? [" · ", part] : [part])).flat());
  renderGang(job);
  show("cancel-job", !TERMINAL.has(job.status));
  show("delete-job", TERMINAL.has(job.status));
  show("download-ckpt", kind === "train" && Boolean(job.checkpoint));
  show("export-controls", kind === "train" && done);
  show("promote-form", kind === "train" && done);
  show("download-results", kind === "predict" && done);
  show("download-export", kind === "export" && done);
  show("train-view", kind === "train");
  show("predict-view", kind === "predict");
  show("export-view", kind === "export");
  setProgress(job.progress, job.status);
  if (kind === "train") {
    for (const m of job.metrics) addMetrics(view.series, m);
    const last = job.metrics[job.metrics.length - 1];
    if (last && last.per_class_accuracy) renderPerClass(last.per_class_accuracy);
    redraw();
  }
  if (job.evaluation) {
    const prefix = kind === "train" ? "Kept weights" : "Evaluation";
    renderEvaluation(job.evaluation, resultTitle(prefix, job.dataset_name, job.evaluation));
  }
  $("evaluations-panel").hidden = !(kind === "train" && done);
  if (kind === "train") renderEvaluations(job.evaluations || []);
  if (kind === "train" && done) fitEvaluateDatasets(job);
  if (kind === "predict") renderPredictSummary(job);
  if (kind === "export") renderExportSummary(job);
}

// A data-parallel job: its world size, elasticity and where its ranks run (data-* for scripts).
function renderGang(job) {
  const gang = gangOf(job), line = $("job-gang");
  show("job-gang", Boolean(gang));
  if (!gang) { line.replaceChildren(); return; }
  Object.assign(line.dataset, { worldSize: gang.size, elastic: String(gang.elastic), ranks: gang.ranks.length,
    nodes: gang.nodes.join(" ") });
  line.replaceChildren(...gangLine(gang).flatMap((part, i) => (i ? [" · ", part] : [part])).flat());
}

function setStatus(status) {
  const pill = $("job-status");
  pill.textContent = status; pill.className = `pill ${status}`; pill.dataset.status = status;
}

function setProgress(p, status) {
  const kind = view.job ? kindOf(view.job) : "train";
  const { fraction, text } = progressOf(kind, p, status);
  show("job-progress-box", true);
  $("job-progress").style.width = `${(100 * fraction).toFixed(1)}%`;
  $("job-progress-text").textContent = [text, status].filter(Boolean).join(" · ");
}

export function redraw() { if (view.series) drawCharts(view.series, $("loss-chart"), $("acc-chart")); }

function renderPerClass(perClass) {
  $("per-class").replaceChildren(el("div", { class: "pc-title small muted" }, "Accuracy per class (last epoch)"),
    ...Object.entries(perClass).map(([name, acc]) =>
      el("div", { class: "pc" }, el("span", { class: "pc-name", title: `Accuracy of ${name}` }, name),
        el("span", { class: "bar" }, el("div", { style: `width:${(100 * acc).toFixed(0)}%` })),
        el("span", { class: "small" }, `${(100 * acc).toFixed(0)} %`))));
}

function renderPredictSummary(job) {
  const r = job.results;
  $("predict-summary").textContent = r
    ? `${r.images} images labelled, ${r.errors} unreadable, top ${r.top_k}` +
      (r.accuracy !== null && r.accuracy !== undefined ? `, top-1 accuracy ${(100 * r.accuracy).toFixed(1)} %` : "") +
      ` · ${Math.round(r.images_per_second)} images/s · JSON lines: ${r.url}`
    : TERMINAL.has(job.status) ? "no results file" : "the results file is written as the images are labelled";
}

function renderExportSummary(job) {
  const p = job.params;
  $("export-summary").replaceChildren(`${formatName(p.format)} file of job `,
    el("a", { href: jobHref(p.source_job_id), class: "mono" }, shortId(p.source_job_id)),
    job.status === "succeeded" ? " · built and checked against the checkpoint (parity 1e-4)" : "");
}

function onJobEvent(jobId, event) {
  if (view.id !== jobId) return;
  const d = event.data;
  if (event.event === "progress") setProgress(d, "running");
  else if (event.event === "metrics" && kindOf(view.job) === "train") {
    addMetrics(view.series, d);
    if (d.per_class_accuracy) renderPerClass(d.per_class_accuracy);
    redraw();
  } else if (event.event === "batch_backoff" || event.event === "early_stop") note(d.message);
  else if (event.event === "gang") { view.job = { ...view.job, ranks: d.ranks }; renderGang(view.job); }
  else if (event.event === "status") {
    setStatus(d.status);
    if (TERMINAL.has(d.status)) {
      // the record has the final word (checkpoint, error, results)
      getJSON(`/jobs/${encodeURIComponent(jobId)}`).then((job) => {
        if (view.id === jobId) { renderJob(job); onChange(job); }
      }).catch(() => {});
    }
  }
}

// Said once when the live view loses the server, and cleared once it is back.
function streamNote(reason) {
  $("stream-note").textContent = reason ? `waiting for the server (${reason}); the view reconnects by itself` : "";
  show("stream-note", Boolean(reason));
}

export function note(message) {
  if (message) $("job-note").textContent = `⚠ ${message}`;
  show("job-note", Boolean(message));
}

// ------------------------------------------------------------------ actions
async function cancelJob() {
  try { await api(`/jobs/${encodeURIComponent(view.id)}/cancel`, { method: "POST" }); onChange(null); }
  catch (err) { note(err.message); }
}

async function download(path, fallbackName) {
  try { await saveResponse(await api(path), fallbackName); } catch (err) { note(err.message); }
}

// An export is built by an export job on a worker: GET answers 202 (with Retry-After) until the
// file is ready, then the file. The button waits as the API asks, while this job stays in view.
async function exportJob() {
  const jobId = view.id, format = $("export-format").value, button = $("export-job");
  if (!jobId || button.disabled) return;
  button.disabled = true;
  const label = $("export-format").selectedOptions[0].textContent;
  try {
    for (;;) {
      const response = await api(`/jobs/${encodeURIComponent(jobId)}/export?format=${encodeURIComponent(format)}`);
      if (view.id !== jobId) return;
      if (response.status === 200) {
        $("export-status").textContent = `${label} export downloaded`;
        await saveResponse(response, `${jobId}.${format === "onnx" ? "onnx" : "torchscript.pt"}`);
        return;
      }
      const built = await response.json();
      $("export-status").replaceChildren(`building the ${label} export (job `, el("a", { href: jobHref(built.id), class: "mono" }, shortId(built.id)), `, ${built.status})…`);
      await sleep(1000 * Math.min(5, Math.max(0.5, Number(response.headers.get("Retry-After")) || 1)));
      if (view.id !== jobId) return;
    }
  } catch (err) {
    if (view.id === jobId && !retriable(err)) { $("export-status").textContent = ""; note(err.message); }
    else if (view.id === jobId) note(`${err.message}; press Export again once the server is back`);
  } finally {
    button.disabled = false;
  }
}

// DELETE /jobs/{id}: the job's record, events and files (and a training job's exports). The API
// refuses (409) what must stay, e.g. a job an alias points at; its reason is shown as it is.
async function deleteJob() {
  const jobId = view.id;
  if (!jobId || !confirm(`Delete job ${jobId} with its events and files? This cannot be undone.`)) return;
  try {
    await api(`/jobs/${encodeURIComponent(jobId)}`, { method: "DELETE" });
  } catch (err) {
    note(err.message);
    return;
  }
  location.hash = "#/";
  await openJob(null);
  $("job-meta").textContent = `job ${jobId} deleted`;
  onChange(null);
}

async function promote(event) {
  event.preventDefault();
  const name = $("promote-name").value.trim(), jobId = view.id;
  if (!name || !jobId) return;
  const error = $("alias-error");
  error.hidden = true;
  try {
    const alias = await (await sendJSON(`/aliases/${encodeURIComponent(name)}`, "PUT",
      { job_id: jobId, note: "promoted from the dashboard" })).json();
    const warmed = alias.warm.map((w) => `${w.device}: ${w.status}`).join(", ");
    note(null);
    $("export-status").textContent = `alias ${alias.name} → ${shortId(alias.job_id)}${warmed ? ` (warmed ${warmed})` : ""}`;
    onChange(null);
  } catch (err) { error.textContent = err.message; error.hidden = false; }
}

export function wireJobView() {
  $("cancel-job").addEventListener("click", cancelJob);
  $("download-ckpt").addEventListener("click", () => download(`/jobs/${encodeURIComponent(view.id)}/checkpoint`, `${view.id}.pt`));
  $("download-results").addEventListener("click", () => download(`/jobs/${encodeURIComponent(view.id)}/results`, `predictions-${view.id}.jsonl`));
  $("download-export").addEventListener("click", () => {
    const p = view.job.params;
    download(`/jobs/${encodeURIComponent(p.source_job_id)}/export?format=${encodeURIComponent(p.format)}`,
      `${p.source_job_id}.${p.format === "onnx" ? "onnx" : "torchscript.pt"}`);
  });
  $("export-job").addEventListener("click", exportJob);
  $("delete-job").addEventListener("click", deleteJob);
  $("promote-form").addEventListener("submit", promote);
  $("evaluate-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const jobId = view.id;
    if (jobId) startEvaluation(jobId, () => view.id === jobId);
  });
}
