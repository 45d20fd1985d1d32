// torchyard dashboard: plain JS modules, no libraries, nothing fetched from anywhere but this server.
// Each view has a URL: `#/` the overview, `#/jobs/<id>` a job, `#/sweeps/<id>` a sweep (link, bookmark, reload, back).
import { refreshWhoami, wireProject } from "./access.js";
import { refreshAliases } from "./aliases.js";
import { apiKey, setApiKey } from "./api.js";
import { refreshDevices } from "./devices.js";
import { $ } from "./dom.js";
import { loadChoices, onJobsListed, refreshJobs, refreshStartFrom, startJob } from "./jobs.js";
import { onJobChanged, openJob, redraw, selectedJob, wireJobView } from "./jobview.js";
import { refreshPredictJobs, wirePredict } from "./predict.js";
import { openSweep, refreshSweeps, selectedSweep, wireSweepView } from "./sweeps.js";

function route() {
  const match = location.hash.match(/^#\/jobs\/([^/]+)$/);
  const jobId = match ? decodeURIComponent(match[1]) : null;
  if (jobId !== selectedJob()) openJob(jobId);
  if (jobId) $("job-view").scrollIntoView({ block: "nearest" });
  const sweep = location.hash.match(/^#\/sweeps\/([^/]+)$/);
  const sweepId = sweep ? decodeURIComponent(sweep[1]) : null;
  if (sweepId !== selectedSweep()) openSweep(sweepId);
  if (sweepId) $("sweep-view").scrollIntoView({ block: "nearest" });
}

async function refreshAll() {
  await Promise.all([refreshWhoami(), loadChoices(), refreshDevices(), refreshJobs(), refreshAliases(), refreshSweeps()]);
}

function wire() {
  $("api-key").value = apiKey();
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    setApiKey($("api-key").value.trim());
    refreshAll();
    const current = selectedJob();
    if (current) { openJob(null); openJob(current); }
  });
  wireProject(refreshAll);
  $("job-form").addEventListener("submit", startJob);
  onJobsListed(() => { refreshPredictJobs(); refreshStartFrom(); });
  onJobChanged((job) => {
    refreshJobs().then(() => { if (job && job.status === "succeeded" && (job.kind || "train") === "train") refreshPredictJobs(job.id); });
    refreshAliases();
  });
  wireJobView();
  wirePredict();
  wireSweepView();
  $("footer-url").textContent = location.origin;
  window.addEventListener("resize", redraw);
  window.addEventListener("hashchange", route);
}

wire();
route();
refreshAll();
setInterval(refreshDevices, 2000);
setInterval(refreshJobs, 3000);
setInterval(refreshAliases, 5000);
setInterval(refreshSweeps, 5000);
