// The predict panel: drop an image, see the top-k bars of a trained job's model.
import { api } from "./api.js";
import { $, el, shortId } from "./dom.js";
import { trainedJobs } from "./jobs.js";

let chosen = null;  // the job id the panel predicts with

export function refreshPredictJobs(prefer = null) {
  const select = $("predict-job");
  const done = trainedJobs();
  const values = done.map((j) => j.id);
  if (prefer && values.includes(prefer)) chosen = prefer;
  if ([...select.options].map((o) => o.value).join("|") !== values.join("|")) {
    select.replaceChildren(...done.map((j) => el("option", { value: j.id }, `${j.model} on ${j.dataset_name || j.dataset} · ${shortId(j.id)}`)));
    if (!done.length) select.append(el("option", { value: "" }, "no succeeded job yet"));
  }
  const keep = chosen && values.includes(chosen) ? chosen : values[0];
  if (keep) select.value = keep;
  chosen = keep || null;
}

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

export function wirePredict() {
  const zone = $("drop-zone");
  $("predict-file").addEventListener("change", (e) => { if (e.target.files[0]) predictFile(e.target.files[0]); });
  $("predict-job").addEventListener("change", (e) => { chosen = e.target.value; });
  zone.addEventListener("dragover", (e) => { e.preventDefault(); zone.classList.add("over"); });
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", (e) => {
    e.preventDefault(); zone.classList.remove("over");
    const file = e.dataTransfer.files[0];
    if (file) predictFile(file);
  });
  zone.addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") $("predict-file").click(); });
}
