// A job's server-sent events over fetch() (EventSource cannot send the Authorization header).
//
// The live view outlives what the job outlives: when the API restarts or its Redis is away, the
// stream is resumed with Last-Event-ID (no event lost or repeated), backing off up to 5 s, for as
// long as it takes; `onWait(reason)` says so once, `onWait(null)` once it is back. It ends with the
// job's terminal status, or when `signal` aborts it (another view was opened).
import { api, getJSON, retriable } from "./api.js";
import { TERMINAL, sleep } from "./dom.js";

const MAX_PAUSE_MS = 5000;

export async function followEvents(jobId, { onEvent, onWait, signal }) {
  const path = `/jobs/${encodeURIComponent(jobId)}`;
  let lastId = null;
  let failures = 0;
  let waiting = false;
  const wait = (reason) => { failures += 1; if (!waiting) onWait(reason); waiting = true; };
  const back = () => { if (waiting) onWait(null); waiting = false; failures = 0; };
  while (!signal.aborted) {
    const headers = { Accept: "text/event-stream" };
    if (lastId) headers["Last-Event-ID"] = lastId;
    try {
      const response = await api(`${path}/events`, { headers, signal });
      back();
      for await (const event of readEvents(response.body)) {
        if (event.id) lastId = event.id;
        try { onEvent(event); } catch (err) { err.fatal = true; throw err; } // a bug here is not an outage
        if (event.event === "status" && TERMINAL.has(event.data.status)) return;
      }
      // The stream ended without the terminal status (its Redis went away, or the job had ended
      // before our Last-Event-ID): the record says where the job stands.
      const job = await getJSON(path, { signal });
      if (TERMINAL.has(job.status)) { onEvent({ event: "status", data: { status: job.status } }); return; }
    } catch (err) {
      if (signal.aborted || !retriable(err)) throw err;
      wait(err.message);
    }
    await sleep(failures ? Math.min(MAX_PAUSE_MS, 250 * 2 ** (failures - 1)) : 200);
  }
}

async function* readEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = parseBlock(buffer.slice(0, cut));
      buffer = buffer.slice(cut + 2);
      if (event) yield event;
    }
  }
}

export function parseBlock(block) {
  let id = null, event = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (!line || line.startsWith(":")) continue;
    const i = line.indexOf(":");
    const field = i < 0 ? line : line.slice(0, i);
    let value = i < 0 ? "" : line.slice(i + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "id") id = value;
    else if (field === "event") event = value;
    else if (field === "data") data.push(value);
  }
  if (!data.length) return null;
  let parsed;
  try { parsed = JSON.parse(data.join("\n")); } catch (_) { parsed = { raw: data.join("\n") }; }
  return { id, event, data: parsed };
}
