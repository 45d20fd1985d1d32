// Small DOM and formatting helpers shared by every panel.

export const $ = (id) => document.getElementById(id);

export function el(tag, attrs = {}, ...children) {
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

export const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
export const pct = (v) => (v === null || v === undefined ? "–" : `${(100 * v).toFixed(1)} %`);
export const shortId = (id) => (id ? id.slice(-10) : "–");
export const kindOf = (job) => job.kind || "train";
export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
// `1 epoch`, `3 epochs`: the noun agrees with the number.
export const count = (n, one, many = `${one}s`) => `${n} ${n === 1 ? one : many}`;
// A dataset in a list: its name, its version when a name has several, its id.
export const datasetLabel = (d) => (d.name && d.name !== d.id ? `${d.name}${d.version > 1 ? ` v${d.version}` : ""} (${d.id})` : d.id);
// An export format as its project spells it (never `TORCHSCRIPT`).
const FORMATS = { onnx: "ONNX", torchscript: "TorchScript" };
export const formatName = (format) => FORMATS[format] || format || "";

export function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

export function when(iso) {
  if (!iso) return "–";
  const d = new Date(iso);
  return d.toLocaleString(undefined, { month: "short", day: "numeric", hour: "2-digit", minute: "2-digit", second: "2-digit" });
}

// A job's own link: the job view has a URL (#/jobs/<id>), so it can be bookmarked, shared, reloaded.
export const jobHref = (jobId) => `#/jobs/${encodeURIComponent(jobId)}`;
export const jobLink = (jobId, text = shortId(jobId)) => el("a", { href: jobHref(jobId), class: "mono", title: jobId }, text);

export function show(id, visible) { $(id).hidden = !visible; }
