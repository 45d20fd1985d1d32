// Who the key is (GET /whoami): its role and project shown in the top bar, and `body[data-role]` set
// so the page hides what the role cannot do (style.css); an admin may act in one project (`?project=`
// on every call, app/static/js/api.js), kept in localStorage like the key.
import { getJSON, project, setProject } from "./api.js";
import { $ } from "./dom.js";

export async function refreshWhoami() {
  let me;
  try { me = await getJSON("/whoami"); } catch (_) { return; }
  document.body.dataset.role = me.role;
  const where = me.role === "admin" ? (project() ? `project ${project()}` : "every project") : `project ${me.project}`;
  $("whoami").textContent = `${me.name}: ${me.role}, ${where}`;
}

export function wireProject(onChange) {
  $("project").value = project();
  $("project").addEventListener("change", () => {
    setProject($("project").value.trim());
    refreshWhoami();
    onChange();
  });
}
