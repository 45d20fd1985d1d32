// Calls to this server: every data call sends `Authorization: Bearer <key>` (kept in localStorage);
// the connection dot and the banner say when the server does not answer or wants a key.
import { $ } from "./dom.js";

const KEY_STORAGE = "torchyard.apiKey";
const PROJECT_STORAGE = "torchyard.project";
let key = localStorage.getItem(KEY_STORAGE) || "";
let acting = localStorage.getItem(PROJECT_STORAGE) || "";  // an admin's project ("": every project)

export const project = () => acting;
export function setProject(value) {
  acting = value;
  if (acting) localStorage.setItem(PROJECT_STORAGE, acting); else localStorage.removeItem(PROJECT_STORAGE);
}

// `?project=` on a data call while an admin acts in one project (the server's /v2 and /predict ignore it).
function inProject(path) {
  if (!acting || !path.startsWith("/") || path.startsWith("/static/")) return path;
  return `${path}${path.includes("?") ? "&" : "?"}project=${encodeURIComponent(acting)}`;
}

export const apiKey = () => key;
export function setApiKey(value) {
  key = value;
  if (key) localStorage.setItem(KEY_STORAGE, key); else localStorage.removeItem(KEY_STORAGE);
}

export class ApiError extends Error {
  constructor(status, detail) { super(detail); this.status = status; }
}

// The server is away or restarting (no answer, or a 502/503/504: its Redis is away): try again later.
export const retriable = (err) => err && !err.fatal && err.name !== "AbortError" && (!err.status || err.status >= 502);

export async function api(path, options = {}) {
  let response;
  const headers = { ...(options.headers || {}) };
  if (key) headers.Authorization = `Bearer ${key}`;
  try {
    response = await fetch(inProject(path), { ...options, headers });
  } catch (err) {
    if (err.name === "AbortError") throw err;
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

export const getJSON = async (path, options) => (await api(path, options)).json();

export function sendJSON(path, method, body) {
  return api(path, { method, headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
}

function setConnection(ok, why) {
  const dot = $("conn");
  dot.className = `conn ${ok ? "ok" : "bad"}`;
  dot.title = ok ? "connected" : why || "not connected";
  if (ok && $("banner").dataset.kind === "key") hideBanner();
}

function showBanner(text) { const b = $("banner"); b.textContent = text; b.dataset.kind = "key"; b.hidden = false; }
function hideBanner() { $("banner").hidden = true; }

// Save a download (checkpoint, export, results) under the server's file name.
export async function saveResponse(response, fallbackName) {
  const blob = await response.blob();
  const url = URL.createObjectURL(blob);
  const name = (response.headers.get("Content-Disposition") || "").match(/filename="?([^";]+)"?/);
  const link = document.createElement("a");
  link.href = url;
  link.download = name ? name[1] : fallbackName;
  link.click();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}
