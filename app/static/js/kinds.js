// What each kind of job shows: its progress (epochs for training, batches for an evaluation,
// images for a predict job, steps for an export) and the line that says what it does.
import { count, el, formatName, jobLink, kindOf, TERMINAL } from "./dom.js";

export function progressOf(kind, p, status) {
  const done = status === "succeeded";
  p = p || {};
  if (kind === "train") {
    const inEpoch = p.steps ? p.step / p.steps : 0;
    const fraction = done ? 1 : p.epochs ? Math.min(1, (Math.max(0, p.epoch - 1) + inEpoch) / p.epochs) : 0;
    return { fraction, short: `${p.epoch || 0}/${p.epochs || "?"}`,
             text: p.epochs ? `epoch ${p.epoch}/${p.epochs} · step ${p.step}/${p.steps}` : "" };
  }
  if (kind === "predict") {
    const total = p.images_total, got = p.images_done || 0;
    const rate = p.images_per_second ? ` · ${Math.round(p.images_per_second)} images/s` : "";
    return { fraction: done ? 1 : total ? Math.min(1, got / total) : 0, short: total ? `${got}/${total}` : "–",
             text: total ? `${got} of ${total} images${rate}` : "" };
  }
  // evaluate: batches of the dataset; export: the export's steps (build, check, write)
  const unit = kind === "evaluate" ? "batch" : "step";
  return { fraction: done ? 1 : p.steps ? Math.min(1, p.step / p.steps) : 0,
           short: done ? "done" : p.steps ? `${p.step}/${p.steps}` : "–",
           text: p.steps ? `${unit} ${p.step} of ${p.steps}` : "" };
}

// The line under a job's title: what it is, what it ran with, how it ended.
export function describe(job) {
  const p = job.params || {};
  const ran = job.device_choices || {};  // what the device chose: the batch and schedule that ran
  const kind = kindOf(job);
  const dataset = job.dataset_name || job.dataset;
  const where = job.device ? `on ${job.device}` : `device ${job.requested_device}`;
  const parts = [];
  if (kind === "train") {
    parts.push(`${job.model} on ${dataset}`, where, count(p.epochs, "epoch"), `batch ${ran.batch_size ?? p.batch_size ?? "auto"}`,
      `${p.optimizer} lr ${p.learning_rate}` + ((ran.schedule ?? p.schedule) ? ` ${ran.schedule ?? p.schedule}` : ""));
    if (p.init_from) parts.push(["from job ", jobLink(p.init_from)]);
    if (p.pretrained) parts.push("from ImageNet weights");
    if (job.best_epoch) parts.push(`weights of epoch ${job.best_epoch}`);
    if (job.stop_reason) parts.push(job.stop_reason);
  } else if (kind === "evaluate") {
    parts.push(["evaluates the checkpoint of job ", jobLink(p.trained_job), ` (${job.model}) on ${dataset}`], where);
  } else if (kind === "predict") {
    parts.push(["labels the images of ", dataset, " with job ", jobLink(p.trained_job),
      p.alias ? ` (alias ${p.alias})` : "", ` (${job.model})`], `top ${p.top_k}`, where);
  } else if (kind === "export") {
    parts.push([`${formatName(p.format)} export of job `, jobLink(p.source_job_id), ` (${job.model})`], where);
    if (p.checkpoint_sha256) parts.push(`checkpoint sha256 ${p.checkpoint_sha256.slice(0, 12)}…`);
  }
  const run = job.mlflow;  // its MLflow run, when the service tracks to one (docs/training.md)
  if (run && run.url && /^https?:\/\//.test(run.url)) {
    parts.push([el("a", { class: "mlflow-run", href: run.url, target: "_blank", rel: "noopener noreferrer" }, "MLflow run"),
      run.behind && run.behind.length ? ` (behind: ${run.behind.join(", ")})` : ""]);
  } else if (run && run.behind && run.behind.length) parts.push(`MLflow: behind (${run.behind.join(", ")})`);
  if (job.error) parts.push(`error: ${job.error}`);
  else if (job.message && !TERMINAL.has(job.status)) parts.push(job.message);
  return parts;
}

export const kindLabel = (job) => ({ train: "training", evaluate: "evaluation", predict: "predictions", export: "export" })[kindOf(job)] || kindOf(job);

// A data-parallel job (world_size > 1, docs/api.md): how many devices it asked for, whether it may
// resume on fewer (elastic), and the devices and nodes (a device id's host part) its ranks hold in
// its current or last attempt; null for a single-device job.
export function gangOf(job) {
  const size = job.world_size || 1;
  if (size <= 1) return null;
  const ranks = job.ranks || [];
  const nodes = [...new Set(ranks.map((r) => r.device.split("/")[0]))];
  return { size, elastic: Boolean((job.params || {}).elastic), ranks, nodes };
}

// "×2 elastic" beside a gang job's devices in the jobs table.
export const gangBadge = (gang) => `×${gang.size}${gang.elastic ? " elastic" : ""}`;

// The job view's line about a gang: its size, elasticity, and rank → device (worker) of the attempt.
export function gangLine(gang) {
  const parts = [`data-parallel over ${gang.size} devices`,
    gang.elastic ? "elastic: after a fault it may resume on fewer" : `not elastic: after a fault it waits for all ${gang.size}`];
  if (!gang.ranks.length) parts.push("ranks not placed yet");
  else {
    if (gang.ranks.length < gang.size) parts.push(`running on ${gang.ranks.length} of ${gang.size} after an elastic resume`);
    parts.push(["ranks: ", ...gang.ranks.flatMap((r, i) => [i ? ", " : "",
      el("span", { class: "rank mono", "data-rank": r.rank, "data-device": r.device, title: `worker ${r.worker}` },
        `${r.rank} on ${r.device}`)])]);
    parts.push(`${gang.nodes.length === 1 ? "node" : "nodes"} ${gang.nodes.join(", ")}`);
  }
  return parts;
}
