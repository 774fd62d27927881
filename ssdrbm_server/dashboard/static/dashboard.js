// The dashboard's pages: the jobs list (refreshed every few seconds) and a job's live curves,
// fed by its server-sent events. No framework, no build step: the server sends this file as is.
"use strict";

const BASE = document.body.dataset.base;
const TOKEN_KEY = "ssdrbm-token"; // sessionStorage: this tab only, gone when it closes
const LIST_REFRESH_MS = 2000;
const RECONNECT_MS = 2000;
const SVG = "http://www.w3.org/2000/svg";
const CHARTS = ["reconstruction_error", "log_likelihood", "lr"];

class SignInNeeded extends Error {}

const $ = (id) => document.getElementById(id);

function show(id) {
  for (const view of ["login", "jobs-view", "job-view"]) $(view).hidden = view !== id;
}

function setStatus(text) {
  $("status").textContent = text;
}

// A JSON route of the dashboard, with the bearer token when the tab has one.
async function api(path, method = "GET") {
  const headers = {};
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.authorization = `Bearer ${token}`;
  const response = await fetch(`${BASE}/api${path}`, { method, headers });
  const body = await response.json();
  if (response.status === 401) {
    sessionStorage.removeItem(TOKEN_KEY);
    signIn(token ? body.error : "");
    throw new SignInNeeded(body.error);
  }
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

function signIn(error) {
  show("login");
  $("login-error").textContent = error || "";
  $("token").focus();
}

function number(value, digits = 4) {
  return value === null || value === undefined ? "–" : Number(value).toPrecision(digits);
}

// --- the jobs list ---------------------------------------------------------------------------

async function jobsPage() {
  try {
    const answer = await api("/jobs");
    show("jobs-view");
    renderJobs(answer.jobs);
    $("jobs-more").hidden = !answer.more;
    setStatus(`updated ${new Date().toLocaleTimeString()}`);
  } catch (error) {
    if (error instanceof SignInNeeded) return;
    setStatus(`cannot list jobs: ${error.message}`);
  }
  setTimeout(jobsPage, LIST_REFRESH_MS);
}

function renderJobs(jobs) {
  const body = $("jobs").tBodies[0];
  const rows = jobs.map((job) => {
    const row = document.createElement("tr");
    row.dataset.jobId = job.id;
    const link = document.createElement("a");
    link.href = `${BASE}/jobs/${encodeURIComponent(job.id)}`;
    link.textContent = job.id;
    const cells = [link, job.name, job.state, `${job.step} / ${job.total_steps || "?"}`,
      number(job.reconstruction_error)];
    cells.forEach((content, index) => {
      const cell = row.insertCell();
      cell.append(content);
      if (index >= 3) cell.className = "number";
      if (index === 2) cell.className = `state-${job.state}`;
    });
    return row;
  });
  body.replaceChildren(...rows);
  $("jobs-empty").hidden = jobs.length > 0;
}

// --- a job's curves --------------------------------------------------------------------------

class JobCurves {
  constructor(jobId) {
    this.jobId = jobId;
    this.after = ""; // resume token of the newest event received
    this.ended = false;
    this.series = Object.fromEntries(CHARTS.map((name) => [name, []])); // [step, value]
    this.backoffs = []; // {step, reason}
    this.drawPending = false;
  }

  async start() {
    try {
      const job = await api(`/jobs/${encodeURIComponent(this.jobId)}`);
      show("job-view");
      $("job-title").textContent = job.name ? `${job.name} (${job.id})` : job.id;
      this.job = job;
      this.summarize();
      this.connect();
    } catch (error) {
      if (error instanceof SignInNeeded) return;
      show("job-view");
      $("job-title").textContent = this.jobId;
      setStatus(error.message);
    }
  }

  // The event stream, opened with a fresh single-use ticket (an EventSource cannot send the
  // bearer header); after a drop, it resumes from the last event received.
  async connect() {
    let ticket;
    try {
      ticket = (await api(`/jobs/${encodeURIComponent(this.jobId)}/ticket`, "POST")).ticket;
    } catch (error) {
      if (error instanceof SignInNeeded) return;
      setStatus(`reconnecting: ${error.message}`);
      setTimeout(() => this.connect(), RECONNECT_MS);
      return;
    }
    const query = new URLSearchParams({ ticket, after: this.after });
    const url = `${BASE}/api/jobs/${encodeURIComponent(this.jobId)}/events?${query}`;
    const source = new EventSource(url);
    setStatus("live");
    const on = (kind, handle) => source.addEventListener(kind, (message) => {
      if (message.lastEventId) this.after = message.lastEventId;
      handle(JSON.parse(message.data));
      this.redraw();
    });
    on("metrics", (m) => this.metrics(m));
    on("backoff", (b) => this.backoff(b));
    on("state", (s) => { this.job.state = s.state; this.summarize(); });
    on("failed", (f) => setStatus(`stream interrupted: ${f.error}`));
    on("end", () => { this.ended = true; source.close(); setStatus("the job has ended"); });
    source.onerror = () => { // refused (e.g. too many streams), dropped, or the server stopped
      source.close();
      if (this.ended) return;
      setStatus("disconnected; reconnecting");
      setTimeout(() => this.connect(), RECONNECT_MS);
    };
  }

  metrics(m) {
    for (const name of CHARTS) {
      if (m[name] !== null && m[name] !== undefined) this.series[name].push([m.step, m[name]]);
    }
    this.job.step = m.step;
    this.job.total_steps = m.total_steps || this.job.total_steps;
    this.job.reconstruction_error = m.reconstruction_error;
    this.summarize();
  }

  // Training went back to rollback_step: the steps after it are trained again, so their old
  // points leave the curves, and a marker keeps where the blow-up was seen.
  backoff(b) {
    for (const name of CHARTS) {
      this.series[name] = this.series[name].filter(([step]) => step <= b.rollback_step);
    }
    this.backoffs.push({ step: b.step, reason: b.reason });
  }

  summarize() {
    const job = this.job;
    $("job-summary").textContent = `${job.state} · step ${job.step} / ${job.total_steps || "?"}` +
      ` · reconstruction error ${number(job.reconstruction_error)}` +
      ` · backoffs ${Math.max(job.backoffs || 0, this.backoffs.length)}`;
  }

  redraw() {
    if (this.drawPending) return;
    this.drawPending = true;
    requestAnimationFrame(() => {
      this.drawPending = false;
      for (const name of CHARTS) drawChart($(`chart-${name}`), this.series[name], this.backoffs);
      $("section-log_likelihood").hidden = this.series.log_likelihood.length === 0;
    });
  }
}

// A line chart of [x, y] points with vertical markers, drawn into an <svg>; its data-points
// attribute says how many points are plotted.
function drawChart(svg, points, markers) {
  const width = 640, height = 220, left = 64, right = 12, top = 12, bottom = 28;
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.dataset.points = String(points.length);
  svg.replaceChildren();
  if (points.length === 0) return;
  const xs = points.map((p) => p[0]).concat(markers.map((m) => m.step));
  const ys = points.map((p) => p[1]);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) [y0, y1] = [y0 - Math.abs(y0 || 1) * 0.05, y1 + Math.abs(y1 || 1) * 0.05];
  const x = (v) => left + ((v - x0) / (x1 - x0)) * (width - left - right);
  const y = (v) => height - bottom - ((v - y0) / (y1 - y0)) * (height - top - bottom);
  const add = (tag, attributes, text) => {
    const node = document.createElementNS(SVG, tag);
    for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, value);
    if (text !== undefined) node.textContent = text;
    svg.append(node);
    return node;
  };
  add("line", { class: "axis", x1: left, y1: height - bottom, x2: width - right, y2: height - bottom });
  add("line", { class: "axis", x1: left, y1: top, x2: left, y2: height - bottom });
  add("text", { class: "label", x: 4, y: top + 10 }, number(y1, 3));
  add("text", { class: "label", x: 4, y: height - bottom }, number(y0, 3));
  add("text", { class: "label", x: left, y: height - 8 }, `step ${x0}`);
  add("text", { class: "label", x: width - right, y: height - 8, "text-anchor": "end" }, `${x1}`);
  for (const marker of markers) {
    const line = add("line", { class: "backoff", x1: x(marker.step), y1: top,
      x2: x(marker.step), y2: height - bottom });
    const title = document.createElementNS(SVG, "title");
    title.textContent = `backoff at step ${marker.step}: ${marker.reason}`;
    line.append(title);
  }
  add("polyline", {
    class: "line",
    points: points.map(([px, py]) => `${x(px).toFixed(1)},${y(py).toFixed(1)}`).join(" "),
  });
}

// --- start -----------------------------------------------------------------------------------

function route() {
  const path = location.pathname.slice(BASE.length);
  const job = path.match(/^\/jobs\/([^/]+)$/);
  if (job) new JobCurves(decodeURIComponent(job[1])).start();
  else jobsPage();
}

$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
  $("token").value = "";
  $("logout").hidden = false;
  route();
});

$("logout").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  location.reload();
});
$("logout").hidden = !sessionStorage.getItem(TOKEN_KEY);

route();
