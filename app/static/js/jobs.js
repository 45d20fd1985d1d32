// The jobs table (each row a link to its job's view) and the form that starts a training job.
import { getJSON, sendJSON } from "./api.js";
import { $, datasetLabel, el, jobHref, kindOf, pct, shortId, when } from "./dom.js";
import { fillEvaluateDatasets } from "./evaluations.js";
import { selectedJob } from "./jobview.js";
import { gangBadge, gangOf, progressOf } from "./kinds.js";

export const state = { jobs: [] };
const listeners = [];
export function onJobsListed(callback) { listeners.push(callback); }
export const trainedJobs = () => state.jobs.filter((j) => j.status === "succeeded" && kindOf(j) === "train");

export async function refreshJobs() {
  let jobs;
  try { jobs = (await getJSON("/jobs?limit=50")).jobs; } catch (_) { return; }
  state.jobs = jobs;
  const body = $("jobs-table").tBodies[0];
  body.replaceChildren();
  if (!jobs.length) body.append(el("tr", {}, el("td", { colSpan: 9, class: "muted" }, "no jobs yet: start one above")));
  for (const j of jobs) {
    const kind = kindOf(j);
    const progress = progressOf(kind, j.progress, j.status);
    const last = j.metrics.length ? j.metrics[j.metrics.length - 1] : null;
    const accuracy = j.evaluation ? pct(j.evaluation.accuracy) : last ? pct(last.val_accuracy)
      : j.results && j.results.accuracy !== null && j.results.accuracy !== undefined ? pct(j.results.accuracy) : "–";
    body.append(el("tr", { "data-id": j.id, "data-status": j.status, "data-kind": kind,
      class: j.id === selectedJob() ? "selected" : "", onclick: (e) => { if (e.target.tagName !== "A") location.hash = jobHref(j.id); } },
      el("td", {}, el("a", { href: jobHref(j.id), class: "mono", title: j.id }, shortId(j.id))),
      el("td", { class: "small muted" }, kind),
      el("td", {}, j.model), el("td", { title: j.dataset }, j.dataset_name || j.dataset),
      el("td", {}, el("span", { class: `pill ${j.status}`, title: j.error || j.message || "" }, j.status)),
      el("td", {}, el("span", { class: "mini" }, el("div", { style: `width:${(100 * progress.fraction).toFixed(0)}%` })), progress.short),
      el("td", {}, accuracy),
      deviceCell(j),
      el("td", { class: "small muted" }, when(j.created_at))));
  }
  for (const callback of listeners) callback(jobs);
}

// A job's device; a gang job's: its size (and elastic), then the devices its ranks hold.
function deviceCell(job) {
  const gang = gangOf(job);
  if (!gang) return el("td", { class: "mono small" }, job.device || job.requested_device);
  const devices = gang.ranks.length ? gang.ranks.map((r) => r.device) : [job.requested_device];
  return el("td", { class: "mono small gang", "data-world-size": gang.size, "data-elastic": String(gang.elastic),
    "data-devices": gang.ranks.map((r) => r.device).join(" "),
    title: gang.ranks.map((r) => `rank ${r.rank}: ${r.device} (${r.worker})`).join("\n") || "ranks not placed yet" },
  el("span", { class: "pill gang" }, gangBadge(gang)), " ", devices.join(" "));
}

export async function loadChoices() {
  try {
    const [models, datasets] = await Promise.all([getJSON("/models"), getJSON("/datasets")]);
    const keepModel = $("model").value, keepData = $("dataset").value;
    $("model").replaceChildren(...models.models.map((m) => el("option", { value: m.name, title: m.description }, m.name)));
    $("dataset").replaceChildren(...datasets.datasets.map((d) =>
      el("option", { value: d.id, disabled: d.available === false }, datasetLabel(d))));
    if (keepModel) $("model").value = keepModel;
    if (keepData) $("dataset").value = keepData;
    else if (datasets.datasets.some((d) => d.id === "fake")) $("dataset").value = "fake";
    fillEvaluateDatasets(datasets.datasets);
  } catch (_) { /* the banner says why */ }
}

export function refreshStartFrom() {
  const select = $("start-from");
  const jobs = trainedJobs();
  const values = ["", "pretrained", ...jobs.map((j) => j.id)];
  if ([...select.options].map((o) => o.value).join("|") === values.join("|")) return;
  const keep = select.value;
  select.replaceChildren(el("option", { value: "" }, "scratch"), el("option", { value: "pretrained" }, "ImageNet weights (pretrained)"),
    ...jobs.map((j) => el("option", { value: j.id }, `job ${shortId(j.id)}: ${j.model} on ${j.dataset_name || j.dataset}`)));
  if (values.includes(keep)) select.value = keep;
}

export async function startJob(event) {
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
    const job = await (await sendJSON("/jobs", "POST", body)).json();
    await refreshJobs();
    location.hash = jobHref(job.id);
  } catch (err) {
    error.textContent = err.message; error.hidden = false;
  } finally {
    button.disabled = false;
  }
}
