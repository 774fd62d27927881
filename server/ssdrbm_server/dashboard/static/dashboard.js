// The dashboard's pages: the jobs and sweeps lists (refreshed every few seconds), a job's live
// curves, fed by its server-sent events, with its model's filters, and a sweep's leaderboard
// with one curve per run (polled). No framework, no build step: the server sends this file as is.
"use strict";

const BASE = document.body.dataset.base;
const TOKEN_KEY = "ssdrbm-token"; // sessionStorage: this tab only, gone when it closes
const LIST_REFRESH_MS = 2000;
const RECONNECT_MS = 2000;
const SVG = "http://www.w3.org/2000/svg";
const CHARTS = ["reconstruction_error", "log_likelihood", "lr"];
// Series drawn as curves: each chart's own, and the likelihood's lower bound beside it.
const SERIES = [...CHARTS, "log_likelihood_lower"];
const STDERR = { log_likelihood: "log_likelihood_stderr",
  log_likelihood_lower: "log_likelihood_lower_stderr" }; // a band of ± one standard error
const FILTERS_RETRY_MS = 5000; // a running job without a checkpoint yet: ask again after this
// A run's curve colour, by its place in the sweep; the palette repeats past its length.
const PALETTE = ["#1a6fd1", "#d9480f", "#2b8a3e", "#862e9c", "#e67700", "#0b7285", "#c2255c",
  "#5c940d", "#364fc7", "#868e96"];
const ENDED = new Set(["SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED"]);

class SignInNeeded extends Error {}

const $ = (id) => document.getElementById(id);

function show(id) {
  for (const view of ["login", "jobs-view", "job-view", "sweep-view"]) $(view).hidden = view !== id;
}

function setStatus(text) {
  $("status").textContent = text;
}

// A route of the dashboard, with the bearer token when the tab has one; errors are JSON.
async function request(path, method = "GET") {
  const headers = {};
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.authorization = `Bearer ${token}`;
  const response = await fetch(`${BASE}/api${path}`, { method, headers });
  if (response.ok) return response;
  const body = await response.json();
  if (response.status === 401) {
    sessionStorage.removeItem(TOKEN_KEY);
    signIn(token ? body.error : "");
    throw new SignInNeeded(body.error);
  }
  throw new Error(body.error || response.statusText);
}

async function api(path, method = "GET") {
  return (await request(path, method)).json();
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
    const [answer, sweeps] = await Promise.all([api("/jobs"), api("/sweeps")]);
    show("jobs-view");
    renderJobs(answer.jobs);
    $("jobs-more").hidden = !answer.more;
    renderSweeps(sweeps.sweeps);
    $("sweeps-more").hidden = !sweeps.more;
    setStatus(`updated ${new Date().toLocaleTimeString()}`);
  } catch (error) {
    if (error instanceof SignInNeeded) return;
    setStatus(`cannot list jobs: ${error.message}`);
  }
  setTimeout(jobsPage, LIST_REFRESH_MS);
}

function link(kind, id) {
  const anchor = document.createElement("a");
  anchor.href = `${BASE}/${kind}/${encodeURIComponent(id)}`;
  anchor.textContent = id;
  return anchor;
}

// A table row of cells; `state` is the index of the state cell, numbers start at `numbers`.
function tableRow(cells, state, numbers) {
  const row = document.createElement("tr");
  cells.forEach((content, index) => {
    const cell = row.insertCell();
    cell.append(content);
    if (index >= numbers) cell.className = "number";
    if (index === state) cell.className = `state-${content}`;
  });
  return row;
}

function renderJobs(jobs) {
  const rows = jobs.map((job) => {
    const row = tableRow([link("jobs", job.id), job.name, job.state,
      `${job.step} / ${job.total_steps || "?"}`, number(job.reconstruction_error)], 2, 3);
    row.dataset.jobId = job.id;
    // A running job's time left, as `ssdrbm watch` shows it (the server computes it).
    const eta = row.insertCell();
    eta.className = "eta number";
    eta.textContent = job.eta || "";
    // A queued job's place ("3 ahead; about 40 s"), with how it was estimated on hover.
    const queue = row.insertCell();
    queue.className = "queue";
    queue.textContent = job.queue ? job.queue.summary : "";
    if (job.queue) queue.title = job.queue.basis;
    return row;
  });
  $("jobs").tBodies[0].replaceChildren(...rows);
  $("jobs-empty").hidden = jobs.length > 0;
}

function renderSweeps(sweeps) {
  const rows = sweeps.map((sweep) => {
    const best = sweep.best_job_id ? link("jobs", sweep.best_job_id) : "–";
    const row = tableRow([link("sweeps", sweep.id), sweep.name, sweep.state,
      String(sweep.run_count), best], 2, 3);
    row.dataset.sweepId = sweep.id;
    return row;
  });
  $("sweeps").tBodies[0].replaceChildren(...rows);
  $("sweeps-empty").hidden = sweeps.length > 0;
}

// --- a job's curves --------------------------------------------------------------------------

class JobCurves {
  constructor(jobId) {
    this.jobId = jobId;
    this.after = ""; // resume token of the newest event received
    this.ended = false;
    this.series = Object.fromEntries(SERIES.map((name) => [name, []])); // [step, value, stderr]
    this.markers = []; // {step, kind: backoff, preempted or resumed, title}
    this.drawPending = false;
  }

  async start() {
    try {
      const job = await api(`/jobs/${encodeURIComponent(this.jobId)}`);
      show("job-view");
      $("job-title").textContent = job.name ? `${job.name} (${job.id})` : job.id;
      this.job = job;
      this.summarize();
      this.filters = new Filters(this.jobId);
      this.filters.load();
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
    on("state", (s) => this.state(s));
    on("failed", (f) => setStatus(`stream interrupted: ${f.error}`));
    on("end", () => {
      this.ended = true;
      source.close();
      setStatus("the job has ended");
      this.filters.load(); // its last checkpoint
    });
    source.onerror = () => { // refused (e.g. too many streams), dropped, or the server stopped
      source.close();
      if (this.ended) return;
      setStatus("disconnected; reconnecting");
      setTimeout(() => this.connect(), RECONNECT_MS);
    };
  }

  metrics(m) {
    for (const name of SERIES) {
      if (m[name] === null || m[name] === undefined) continue;
      this.series[name].push([m.step, m[name], STDERR[name] ? m[STDERR[name]] : null]);
    }
    this.job.step = m.step;
    this.job.total_steps = m.total_steps || this.job.total_steps;
    this.job.reconstruction_error = m.reconstruction_error;
    this.job.eta = m.eta;
    this.summarize();
    this.filters.refreshIfMissing();
  }

  // Training went back to rollback_step: the steps after it are trained again, so their old
  // points leave the curves, and a marker keeps where the blow-up was seen.
  backoff(b) {
    this.trainAgainAfter(b.rollback_step);
    this.markers.push({ step: b.step, kind: "backoff",
      title: `backoff at step ${b.step}: ${b.reason}` });
  }

  trainAgainAfter(step) {
    for (const name of SERIES) {
      this.series[name] = this.series[name].filter(([at]) => at <= step);
    }
  }

  // A state change; a preemption at a time slice's end, and the claim that resumed the job
  // from its checkpoint, are marked on the curves (the server names them in `marker`). A
  // resumed job trains the steps after its checkpoint again: their old points leave the curves.
  state(s) {
    this.job.state = s.state;
    this.job.step = s.marker === "resumed" ? s.step : Math.max(this.job.step, s.step);
    if (s.marker === "preempted") {
      const why = s.message.replace(/^preempted:\s*/, "");
      this.markers.push({ step: s.step, kind: "preempted",
        title: `preempted at step ${s.step}: ${why}` });
    } else if (s.marker === "resumed") {
      this.trainAgainAfter(s.step);
      this.markers.push({ step: s.step, kind: "resumed",
        title: `resumed at step ${s.step}: ${s.message}` });
    }
    this.summarize();
  }

  count(kind) {
    return this.markers.filter((marker) => marker.kind === kind).length;
  }

  summarize() {
    const job = this.job;
    const preempted = this.count("preempted");
    $("job-summary").textContent = `${job.state} · step ${job.step} / ${job.total_steps || "?"}` +
      (job.state === "RUNNING" && job.eta ? ` · ETA ${job.eta}` : "") +
      ` · reconstruction error ${number(job.reconstruction_error)}` +
      ` · backoffs ${Math.max(job.backoffs || 0, this.count("backoff"))}` +
      (preempted ? ` · preempted ${preempted}×` : "") +
      (job.state === "QUEUED" && job.queue ? ` · queued: ${job.queue.summary}` : "");
  }

  redraw() {
    if (this.drawPending) return;
    this.drawPending = true;
    requestAnimationFrame(() => {
      this.drawPending = false;
      for (const name of CHARTS.filter((chart) => chart !== "log_likelihood")) {
        drawChart($(`chart-${name}`), this.series[name], this.markers);
      }
      this.drawLikelihood();
    });
  }

  // The log-likelihood with a band of ± one standard error; with eval.ais, AIS's estimate
  // (optimistic) and reverse AIS's lower bound (conservative) as two labelled lines.
  drawLikelihood() {
    const upper = this.series.log_likelihood, lower = this.series.log_likelihood_lower;
    const bounded = lower.length > 0;
    const lines = [{ points: upper, band: true, label: bounded ? "AIS estimate" : "" }];
    if (bounded) lines.push({ points: lower, band: true, kind: "lower", label: "lower bound" });
    drawLines($("chart-log_likelihood"), lines, this.markers);
    $("section-log_likelihood").hidden = upper.length === 0 && !bounded;
    $("likelihood-bounds").hidden = !bounded;
  }
}

// The latest checkpoint's filters, a PNG the server draws (fetched with the bearer token, so
// shown as a data: URL). A job without a checkpoint yet is asked again now and then.
class Filters {
  constructor(jobId) {
    this.path = `/jobs/${encodeURIComponent(jobId)}/filters.png`;
    this.shown = false;
    this.triedAt = 0;
  }

  refreshIfMissing() {
    if (!this.shown && Date.now() - this.triedAt > FILTERS_RETRY_MS) this.load();
  }

  async load() {
    this.triedAt = Date.now();
    let response;
    try {
      response = await request(this.path);
    } catch (error) {
      return; // no checkpoint yet (412), or it went away: the section stays as it was
    }
    const step = response.headers.get("x-checkpoint-step");
    const reader = new FileReader();
    reader.onload = () => {
      $("filters").src = reader.result;
      $("filters").dataset.step = step;
      $("filters-caption").textContent = `checkpoint at step ${step}`;
      $("section-filters").hidden = false;
      this.shown = true;
    };
    reader.readAsDataURL(await response.blob());
  }
}

// --- a sweep's leaderboard -------------------------------------------------------------------

// The leaderboard polls the sweep (as GetSweep reads it); each run's curve of the rank metric
// grows by the points its history route returns after the last one it sent.
class SweepBoard {
  constructor(sweepId) {
    this.sweepId = sweepId;
    this.curves = new Map(); // job id -> {points, after, colour, done}
  }

  async poll() {
    try {
      const sweep = await api(`/sweeps/${encodeURIComponent(this.sweepId)}`);
      show("sweep-view");
      this.render(sweep);
      await this.readCurves(sweep);
      this.draw(sweep);
      const ended = sweep.state !== "RUNNING" && [...this.curves.values()].every((c) => c.done);
      setStatus(ended ? "the sweep has ended" : `updated ${new Date().toLocaleTimeString()}`);
      if (ended) return;
    } catch (error) {
      if (error instanceof SignInNeeded) return;
      show("sweep-view");
      if (!$("sweep-title").textContent) $("sweep-title").textContent = this.sweepId;
      setStatus(error.message);
      if (error.message.includes("not found")) return;
    }
    setTimeout(() => this.poll(), LIST_REFRESH_MS);
  }

  render(sweep) {
    $("sweep-title").textContent = sweep.name ? `${sweep.name} (${sweep.id})` : sweep.id;
    $("sweep-summary").textContent = `${sweep.state} · ${sweep.run_count} runs · ranked by ` +
      `${sweep.rank_metric}` + (sweep.best_job_id ? ` · best ${sweep.best_job_id}` : "");
    $("rank-metric-head").textContent = sweep.rank_metric;
    $("runs-chart-title").textContent = `${sweep.rank_metric} per run`;
    const rows = sweep.runs.map((run) => {
      const point = Object.entries(run.point).map(([k, v]) => `${k}=${v}`).join(", ");
      const row = tableRow([run.rank ? String(run.rank) : "–", link("jobs", run.job_id), point,
        run.state, `${run.step} / ${run.total_steps || "?"}`, number(run.rank_value)], 3, 4);
      row.dataset.jobId = run.job_id;
      row.dataset.rank = String(run.rank);
      if (run.job_id === sweep.best_job_id) row.classList.add("best");
      return row;
    });
    $("leaderboard").tBodies[0].replaceChildren(...rows);
  }

  // One history request at a time: each holds one of the tenant's stream slots while it reads.
  async readCurves(sweep) {
    for (const run of sweep.runs) {
      if (!this.curves.has(run.job_id)) {
        const colour = PALETTE[this.curves.size % PALETTE.length];
        this.curves.set(run.job_id, { points: [], after: "", colour, done: false });
      }
      const curve = this.curves.get(run.job_id);
      if (curve.done || run.state === "EXPIRED") { curve.done = true; continue; }
      const query = new URLSearchParams({ metric: sweep.rank_metric, after: curve.after });
      try {
        const answer = await api(`/jobs/${encodeURIComponent(run.job_id)}/history?${query}`);
        const first = answer.points.length ? answer.points[0][0] : Infinity;
        curve.points = curve.points.filter(([step]) => step < first).concat(answer.points);
        curve.after = answer.after;
        curve.done = ENDED.has(run.state) && !answer.more;
      } catch (error) {
        if (error instanceof SignInNeeded) throw error;
        setStatus(`run ${run.job_id}: ${error.message}`); // e.g. no stream slot: next poll
      }
    }
  }

  draw(sweep) {
    const lines = sweep.runs.filter((run) => this.curves.has(run.job_id)).map((run) => {
      const curve = this.curves.get(run.job_id);
      const best = run.job_id === sweep.best_job_id;
      return { points: curve.points, colour: curve.colour, best, title: run.job_id };
    });
    lines.sort((a, b) => a.best - b.best); // the best drawn last, on top
    drawLines($("chart-runs"), lines, []);
  }
}

// A line chart of [x, y] points with vertical markers, drawn into an <svg>; its data-points
// attribute says how many points are plotted.
function drawChart(svg, points, markers) {
  drawLines(svg, [{ points }], markers);
}

// Line charts of several series ({points, colour, best, title, band, kind, label}) on shared
// axes; data-points counts every point plotted and data-lines the series with any. A series
// with `band` shades ± the standard error its points carry third ([step, value, stderr]); one
// with a `label` is named at its last point. Markers ({step, kind, title}) are vertical lines
// of class `kind`.
function drawLines(svg, lines, markers) {
  const width = 640, height = 220, left = 64, right = 12, top = 12, bottom = 28;
  const points = lines.flatMap((line) => line.points);
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.dataset.points = String(points.length);
  svg.dataset.lines = String(lines.filter((line) => line.points.length > 0).length);
  svg.replaceChildren();
  if (points.length === 0) return;
  const xs = points.map((p) => p[0]).concat(markers.map((m) => m.step));
  const spread = (p) => (Number.isFinite(p[2]) ? p[2] : 0);
  const ys = points.flatMap((p) => [p[1] - spread(p), p[1] + spread(p)]);
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
  const xy = ([px, py]) => `${x(px).toFixed(1)},${y(py).toFixed(1)}`;
  for (const marker of markers) {
    const line = add("line", { class: `marker ${marker.kind}`, x1: x(marker.step), y1: top,
      x2: x(marker.step), y2: height - bottom });
    const title = document.createElementNS(SVG, "title");
    title.textContent = marker.title;
    line.append(title);
  }
  for (const line of lines) {
    const kind = line.kind ? ` ${line.kind}` : "";
    if (line.band && line.points.some((p) => spread(p) > 0)) {
      const high = line.points.map(([px, py, se]) => xy([px, py + (se || 0)]));
      const low = line.points.map(([px, py, se]) => xy([px, py - (se || 0)])).reverse();
      add("polygon", { class: `band${kind}`, points: high.concat(low).join(" ") });
    }
    const attributes = { points: line.points.map(xy).join(" ") };
    if (line.colour) {
      attributes.class = line.best ? "run best" : "run";
      attributes.stroke = line.colour;
    } else attributes.class = `line${kind}`;
    const polyline = add("polyline", attributes);
    if (line.label && line.points.length) {
      const [px, py] = line.points[line.points.length - 1];
      const below = line.kind === "lower"; // a lower bound's name under its line
      add("text", { class: `label series${kind}`, x: Math.min(x(px), width - right) - 4,
        y: y(py) + (below ? 14 : -6), "text-anchor": "end" }, line.label);
    }
    if (line.title) {
      const title = document.createElementNS(SVG, "title");
      title.textContent = line.title + (line.best ? " (best)" : "");
      polyline.append(title);
    }
  }
}

// --- start -----------------------------------------------------------------------------------

function route() {
  const path = location.pathname.slice(BASE.length);
  const job = path.match(/^\/jobs\/([^/]+)$/);
  const sweep = path.match(/^\/sweeps\/([^/]+)$/);
  if (job) new JobCurves(decodeURIComponent(job[1])).start();
  else if (sweep) new SweepBoard(decodeURIComponent(sweep[1])).poll();
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
