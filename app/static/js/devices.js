// The devices panel: each worker's device with live memory and utilisation, and its current job.
import { getJSON } from "./api.js";
import { $, bytes, el, jobLink } from "./dom.js";

export async function refreshDevices() {
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
        d.current_job ? el("span", {}, "running ", jobLink(d.current_job)) : el("span", { class: "muted" }, "no job"),
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
