// Evaluation results: per-class bars and the confusion matrix as a heat-map table; a training
// job's evaluations (each a job of its own, linked to its view) and the form to start another.
import { getJSON, sendJSON } from "./api.js";
import { $, count, datasetLabel, el, jobLink, pct, shortId, sleep, TERMINAL } from "./dom.js";

export function clearEvaluation() {
  $("evaluation-view").hidden = true;
  $("evaluations-panel").hidden = true;
  $("confusion").replaceChildren();
  $("eval-bars").replaceChildren();
  $("evaluations").tBodies[0].replaceChildren();
  $("evaluate-error").hidden = true;
}

export function resultTitle(prefix, datasetName, r) {
  const what = r.split === "validation" ? `validation split, weights of epoch ${r.epoch}` : r.split === "test" ? "test split" : "all images";
  return `${prefix} on ${datasetName || r.dataset} (${what}): accuracy ${pct(r.accuracy)}, loss ${r.loss.toFixed(4)}, ${count(r.num_images, "image")}`;
}

export function renderEvaluation(result, title) {
  $("evaluation-title").textContent = title;
  $("eval-bars").replaceChildren(el("div", { class: "pc-title small muted" }, "Accuracy per class"),
    ...Object.entries(result.per_class_accuracy).map(([name, acc]) =>
      el("div", { class: "pc", "data-class": name }, el("span", { class: "pc-name", title: `Accuracy of ${name}` }, name),
        el("span", { class: "bar" }, el("div", { style: `width:${(100 * acc).toFixed(0)}%` })),
        el("span", { class: "small" }, `${(100 * acc).toFixed(0)} %`))));
  drawConfusion($("confusion"), result.classes, result.confusion_matrix);
  $("evaluation-view").hidden = false;
}

// Rows are the true classes, columns the predicted ones; a cell's shade is its share of its row,
// so a dark diagonal is a good model.
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

export function renderEvaluations(evaluations) {
  const body = $("evaluations").tBodies[0];
  body.replaceChildren();
  if (!evaluations.length) body.append(el("tr", {}, el("td", { colSpan: 6, class: "muted" }, "no evaluations yet")));
  for (const e of evaluations) {
    const r = e.result;
    body.append(el("tr", { "data-id": e.id, "data-status": e.status, onclick: () => {
      if (r) renderEvaluation(r, resultTitle(`Evaluation ${shortId(e.id)}`, e.dataset_name, r));
    } },
    el("td", {}, jobLink(e.id)), el("td", { title: e.dataset }, e.dataset_name || e.dataset),
    el("td", {}, el("span", { class: `pill ${e.status}`, title: e.error || "" }, e.status)),
    el("td", {}, r ? String(r.num_images) : "–"), el("td", {}, r ? pct(r.accuracy) : "–"), el("td", {}, r ? r.loss.toFixed(4) : "–")));
  }
}

// The datasets a model can be evaluated on are those whose every class is one of its own (the
// server's rule, core/kinds/evaluate/submit.py), on disk, labelled and of two classes or more; the
// others stay listed, greyed out with the reason. The default: the set's `-test` sibling, else the
// set it trained on, else the first that fits.
let knownDatasets = [];
let evaluatedJob = null;

export function fillEvaluateDatasets(datasets) {
  knownDatasets = datasets;
  fitEvaluateDatasets(evaluatedJob);
}

function unfitReason(d, job) {
  if (d.available === false) return "not on this server's disk";
  if (d.labeled === false) return "no classes (batch predictions only)";
  const classes = d.classes || [];
  if (classes.length < 2) return "fewer than two classes";
  const model = new Set(job.classes || []);
  const other = classes.filter((c) => !model.has(c));
  return other.length ? `classes the model does not have: ${other.slice(0, 3).join(", ")}${other.length > 3 ? " …" : ""}` : "";
}

export function fitEvaluateDatasets(job) {
  const select = $("evaluate-dataset");
  const keep = job && evaluatedJob && evaluatedJob.id === job.id ? select.value : "";  // this job's own choice
  evaluatedJob = job;
  if (!job) { select.replaceChildren(); return; }
  const reasons = new Map(knownDatasets.map((d) => [d.id, unfitReason(d, job)]));
  select.replaceChildren(...knownDatasets.map((d) => {
    const label = datasetLabel(d);
    const reason = reasons.get(d.id);
    return el("option", { value: d.id, disabled: Boolean(reason), title: reason || "" }, reason ? `${label} — ${reason}` : label);
  }));
  const fits = (id) => id && reasons.get(id) === "";
  const own = knownDatasets.find((d) => d.id === job.dataset);
  const sibling = own && knownDatasets.find((d) => d.name === `${own.name}-test` && fits(d.id));
  const choice = [keep, sibling && sibling.id, job.dataset, ...knownDatasets.map((d) => d.id)].find(fits);
  select.value = choice || "";
  $("evaluate-start").disabled = !choice;
}

// POST /jobs/{id}/evaluate, then the evaluations table polled until this one ends (while the
// training job stays in view).
export async function startEvaluation(jobId, stillViewing) {
  const error = $("evaluate-error");
  error.hidden = true;
  try {
    const created = await (await sendJSON(`/jobs/${encodeURIComponent(jobId)}/evaluate`, "POST",
      { dataset: $("evaluate-dataset").value })).json();
    for (let i = 0; i < 600 && stillViewing(); i += 1) {
      const job = await getJSON(`/jobs/${encodeURIComponent(jobId)}`);
      if (!stillViewing()) return;
      renderEvaluations(job.evaluations || []);
      const mine = (job.evaluations || []).find((e) => e.id === created.id);
      if (mine && TERMINAL.has(mine.status)) {
        if (mine.result) renderEvaluation(mine.result, resultTitle(`Evaluation ${shortId(mine.id)}`, mine.dataset_name, mine.result));
        else if (mine.error) { error.textContent = mine.error; error.hidden = false; }
        return;
      }
      await sleep(700);
    }
  } catch (err) {
    error.textContent = err.message; error.hidden = false;
  }
}
