// Stable names clients predict with (`alias` instead of `job_id`); a succeeded training job is
// promoted from its view, and the server loads it where the old target is resident before moving.
import { getJSON, sendJSON } from "./api.js";
import { $, el, jobLink, shortId, when } from "./dom.js";

export async function refreshAliases() {
  let aliases;
  try { aliases = (await getJSON("/aliases")).aliases; } catch (_) { return; }
  const body = $("aliases-table").tBodies[0];
  body.replaceChildren();
  if (!aliases.length) body.append(el("tr", {}, el("td", { colSpan: 7, class: "muted" }, "no aliases yet: promote a succeeded job")));
  for (const a of aliases) {
    body.append(el("tr", { "data-alias": a.name, "data-job": a.job_id },
      el("td", { class: "mono" }, a.name),
      el("td", {}, jobLink(a.job_id)),
      el("td", {}, a.model),
      el("td", { class: "mono small", title: a.previous_job_id || "" }, shortId(a.previous_job_id)),
      el("td", { class: "small muted" }, when(a.updated_at)),
      el("td", { class: "small muted", title: a.note || "" }, a.updated_by || "–"),
      el("td", {}, a.previous_job_id ? el("button", { type: "button", class: "small needs-write", onclick: () => rollback(a.name) }, "Roll back") : "")));
  }
}

async function rollback(name) {
  const error = $("alias-error");
  error.hidden = true;
  try {
    await sendJSON(`/aliases/${encodeURIComponent(name)}/rollback`, "POST", { note: "rolled back from the dashboard" });
    await refreshAliases();
  } catch (err) { error.textContent = err.message; error.hidden = false; }
}
