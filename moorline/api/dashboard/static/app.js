// Moorline dashboard: a single page over the public JSON API and its event streams.
//
// No framework and no build step: the page is a handful of views, each a function that draws
// into <main> and registers what to stop (timers, streams) when the view changes. Everything
// shown comes from the same routes every client uses, with `Authorization: Bearer`; the token
// lives in this tab's sessionStorage only. Data is always put in the page as text
// (textContent), never as markup, so a run's input or output cannot inject anything.
"use strict";

const TOKEN_KEY = "moorline.token";
const ROLE_KEY = "moorline.role";
const POLL_MS = 2000;
const MAX_EVENT_LINES = 500;
const TERMINAL = new Set(["succeeded", "failed", "cancelled", "timed_out", "rate_limited"]);
// What POST …/retry takes back to queued; every other status answers 409 run_not_retryable.
const RETRYABLE = new Set(["failed", "timed_out"]);
const STATUSES = ["pending", "queued", "running", "waiting", "succeeded", "failed",
  "cancelled", "timed_out", "rate_limited"];

// ---- session and API --------------------------------------------------------------------

const session = {
  get token() { return sessionStorage.getItem(TOKEN_KEY); },
  get role() { return sessionStorage.getItem(ROLE_KEY); },
  get isAdmin() { return this.role === "admin"; },
  save(token, role, label) {
    sessionStorage.setItem(TOKEN_KEY, token);
    sessionStorage.setItem(ROLE_KEY, role);
    sessionStorage.setItem("moorline.label", label);
  },
  clear() { sessionStorage.clear(); },
};

class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

async function api(path, { method = "GET", body, token = session.token, signal } = {}) {
  const headers = { Authorization: `Bearer ${token}`, Accept: "application/json" };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {
    method, headers, signal, body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await response.text();
  let data = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    // Not JSON: a proxy's error page, say. The status line says what happened.
  }
  if (!response.ok) {
    const error = (data && data.error) || {};
    if (response.status === 401 && token === session.token) signOut();
    throw new ApiError(response.status, error.code || "http_error",
      error.message || `HTTP ${response.status}`);
  }
  return data;
}

// Where the signed-in caller reads runs: the admin sees every tenant's under /v1/admin.
function runsBase() { return session.isAdmin ? "/v1/admin/runs" : "/v1/runs"; }

// EventSource cannot send an Authorization header, so the stream is read with fetch() and
// parsed here: blocks separated by a blank line, fields `id:`, `event:`, `data:`; comment
// lines (pings) start with ':'.
async function readEvents(path, lastId, onEvent, signal) {
  const headers = { Authorization: `Bearer ${session.token}`, Accept: "text/event-stream" };
  if (lastId) headers["Last-Event-ID"] = String(lastId);
  const response = await fetch(path, { headers, signal });
  if (!response.ok) {
    const data = await response.json().catch(() => ({}));
    const error = data.error || {};
    throw new ApiError(response.status, error.code, error.message || `HTTP ${response.status}`);
  }
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer = (buffer + value).replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const event = { id: null, type: "message", data: [] };
      for (const line of block.split("\n")) {
        if (!line || line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "id") event.id = text;
        else if (field === "event") event.type = text;
        else if (field === "data") event.data.push(text);
      }
      if (event.data.length) onEvent({ ...event, data: JSON.parse(event.data.join("\n")) });
    }
  }
}

// ---- DOM helpers ------------------------------------------------------------------------

function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (name === "text") node.textContent = value;
    else node.setAttribute(name, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  return node;
}

// Times are shown in UTC, with the zone written: the same instant reads the same for every
// operator, and matches the API's and the logs' times.
function utc(iso) {
  if (!iso) return "—";
  return `${new Date(iso).toISOString().slice(0, 19).replace("T", " ")} UTC`;
}

// A parked run holds no worker slot: say what brings it back, and when it gives up.
const describeWait = (wait) => wait.kind + (wait.model ? ` of ${wait.model}` : "") +
  (wait.until ? ` until ${utc(wait.until)}` : " (no time limit)");
const badge = (status) => h("span", { class: `badge ${status}`, "data-status": status }, status);
// A failed run's error: its fields as JSON, then its traceback as written (one frame a line).
function errorParts(error) {
  if (typeof error !== "object" || typeof error.traceback !== "string") return [json(error)];
  const { traceback, ...rest } = error;
  return [json(rest), h("h3", {}, "Traceback"), h("pre", { class: "traceback" }, traceback)];
}

const json = (value) => h("pre", {}, value === null || value === undefined ? "—"
  : JSON.stringify(value, null, 2));

function age(iso) {
  if (!iso) return "—";
  return duration((Date.now() - Date.parse(iso)) / 1000);
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  if (seconds < 1) return `${Math.max(0, Math.round(seconds * 1000))} ms`;
  if (seconds < 90) return `${seconds.toFixed(1)} s`;
  if (seconds < 5400) return `${Math.round(seconds / 60)} min`;
  if (seconds < 172800) return `${Math.round(seconds / 3600)} h`;
  return `${Math.round(seconds / 86400)} d`;
}

function meter(used, limit) {
  const share = limit > 0 ? Math.min(1, used / limit) : 1;
  const fill = h("div");
  fill.style.width = `${Math.round(share * 100)}%`;  // CSSOM, allowed by the page's CSP
  return h("div", { class: share >= 1 ? "meter full" : "meter", title: `${used} / ${limit}` }, fill);
}

// ---- views ------------------------------------------------------------------------------

const main = document.getElementById("main");
let cleanups = [];

function onLeave(stop) { cleanups.push(stop); }

function every(ms, fn) {
  let stopped = false;
  let timer = null;
  const tick = async () => {
    try { await fn(); } catch (error) { if (!stopped) showError(error); }
    if (!stopped) timer = setTimeout(tick, ms);
  };
  tick();
  onLeave(() => { stopped = true; clearTimeout(timer); });
}

function showError(error) {
  let box = main.querySelector(".error.live");
  if (!box) { box = h("div", { class: "error live", role: "alert" }); main.prepend(box); }
  box.textContent = error.message;
}

function signOut() {
  session.clear();
  // A changed hash renders through the hashchange listener; rendering here as well drew the
  // form twice, and what was typed between the two was lost.
  if (location.hash === "#/signin") route();
  else location.hash = "#/signin";
}

function viewSignIn() {
  const input = h("input", {
    id: "token", type: "password", autocomplete: "off",
    placeholder: "MOORLINE_ADMIN_TOKEN or a tenant's API key",
  });
  const error = h("div", { class: "error", role: "alert" });
  const form = h("form", {
    class: "panel signin",
    onsubmit: async (event) => {
      event.preventDefault();
      error.textContent = "";
      try {
        await signIn(input.value.trim());
        const target = session.isAdmin ? "#/lanes" : "#/runs";
        if (location.hash === target) route(); else location.hash = target;
      } catch (failure) {
        error.textContent = failure.message;
      }
    },
  },
  h("h1", {}, "Sign in"),
  h("p", { class: "note" }, "The token stays in this browser tab only and is sent as "
    + "Authorization: Bearer to the API."),
  input, h("div", { class: "row" }, h("button", { class: "primary", type: "submit" }, "Sign in")),
  error);
  main.replaceChildren(form);
  input.focus();
}

// The admin token opens the admin routes; a tenant's key is refused there (403) and names a
// tenant on /v1/usage.
async function signIn(token) {
  if (!token) throw new Error("paste a token or an API key");
  try {
    await api("/v1/admin/queues", { token });
    session.save(token, "admin", "admin");
    return;
  } catch (error) {
    if (error.status === 401) {
      // require_admin answers 403 to any tenant's key: this is neither.
      throw new Error("this is neither the admin token nor a valid API key");
    }
    if (error.status !== 403) throw error;
  }
  const usage = await api("/v1/usage", { token });
  session.save(token, "tenant", `tenant ${usage.tenant_name} (${usage.plan})`);
}

// Lanes: the load of each lane, polled; throughput is counted here from the newest runs
// polled (runs that finished in each 20 s slice of the last five minutes, per lane).
const SLICE_S = 20;
const SLICES = 15;
const finishedSeen = new Map();  // run_id -> {lane, finishedAt (ms)}

function viewLanes() {
  const cards = h("div", { class: "cards" });
  main.replaceChildren(h("h1", {}, "Lanes"), cards,
    h("p", { class: "note" }, `Throughput: runs finished per ${SLICE_S} s over the last `
      + `${SLICE_S * SLICES / 60} minutes, counted from the ${200} newest runs at each poll.`));
  every(POLL_MS, async () => {
    const [queues, recent] = await Promise.all([
      api("/v1/admin/queues"), api("/v1/admin/runs?limit=200"),
    ]);
    for (const run of recent.runs) {
      if (run.finished_at) {
        finishedSeen.set(run.run_id, { lane: run.queue, finishedAt: Date.parse(run.finished_at) });
      }
    }
    const horizon = Date.now() - SLICE_S * SLICES * 1000;
    for (const [id, seen] of finishedSeen) if (seen.finishedAt < horizon) finishedSeen.delete(id);
    cards.replaceChildren(...queues.lanes.map((lane) => h("div", {
      class: "panel card", "data-lane": lane.lane,
    },
    h("h3", {}, lane.lane),
    h("div", { class: "figures" },
      h("div", { class: "figure" }, h("b", { class: "queued" }, lane.queued), h("span", {}, "queued")),
      h("div", { class: "figure" }, h("b", { class: "running" }, lane.running), h("span", {}, "running")),
      h("div", { class: "figure" }, h("b", {}, lane.oldest_queued_age_s === null ? "—"
        : duration(lane.oldest_queued_age_s)), h("span", {}, "oldest queued"))),
    unservedNote(lane),
    throughputChart(lane.lane))));
  });
}

// Queued runs no live worker serves wait for a worker that has their workflow (a rolling
// deploy, a worker started with another app): say which, since nothing else will run them.
function unservedNote(lane) {
  if (!lane.unserved) return null;
  return h("p", { class: "unserved", role: "status" },
    h("b", {}, `${lane.unserved} unserved`),
    ` — no live worker serves ${lane.unserved_workflows.join(", ")}`);
}

function throughputChart(lane) {
  const now = Date.now();
  const counts = new Array(SLICES).fill(0);
  for (const seen of finishedSeen.values()) {
    if (seen.lane !== lane) continue;
    const slice = SLICES - 1 - Math.floor((now - seen.finishedAt) / (SLICE_S * 1000));
    if (slice >= 0 && slice < SLICES) counts[slice] += 1;
  }
  const top = Math.max(1, ...counts);
  // A y axis (runs per slice, 0 and the peak) left of the bars, an x axis (minutes ago) below.
  const left = 22;
  const width = 240;
  const height = 48;
  const chart = svg("svg", {
    class: "chart", width: width + left, height: height + 26,
    viewBox: `0 0 ${width + left} ${height + 26}`,
    role: "img", "aria-label": `runs finished per ${SLICE_S} s over the last ${SLICE_S * SLICES / 60} min`,
  });
  chart.append(svg("line", { x1: left, x2: left + width, y1: height, y2: height }));
  chart.append(svg("line", { x1: left, x2: left, y1: 0, y2: height }));
  const axisText = (x, y, text, anchor = "start") => {
    const node = svg("text", { x, y, "font-size": 9, fill: "#66707c", "text-anchor": anchor });
    node.textContent = text;
    chart.append(node);
  };
  axisText(left - 3, 8, String(top), "end");
  axisText(left - 3, height, "0", "end");
  axisText(left, height + 10, `−${SLICE_S * SLICES / 60} min`);
  axisText(left + width, height + 10, "now", "end");
  const step = width / SLICES;
  counts.forEach((count, index) => {
    const barHeight = (count / top) * (height - 4);
    const bar = svg("rect", {
      x: left + index * step + 1, width: step - 2, y: height - barHeight, height: barHeight,
    });
    bar.append(svg("title"));
    bar.firstChild.textContent = `${count} finished`;
    chart.append(bar);
  });
  const label = svg("text", { class: "total", x: left, y: height + 22, "font-size": 10,
    fill: "#66707c" });
  label.textContent = `${counts.reduce((a, b) => a + b, 0)} finished; bars: runs per ${SLICE_S} s`;
  chart.append(label);
  return chart;
}

// Runs: a filtered page, refreshed in place; older pages by the API's cursor.
// The search box takes a run id (whole, or the short form shown) or a word of the input; the
// API searches a short id and the input among the newest runs only.
const RUN_ID_PART = /^[0-9a-f]{8}[0-9a-f-]{0,28}$/i;
// A run id's short form: its last 8 characters. Run ids are UUIDv7, whose first 12 digits are
// the time they were made, alike for neighbouring runs; the end is random.
const shortRunId = (id) => id.slice(-8);
// Time ranges offered by the filters, in seconds back from now ("" = any time).
const RANGES = [["", "any time"], ["900", "last 15 min"], ["3600", "last hour"],
  ["86400", "last 24 h"], ["604800", "last 7 days"]];

function rangeSelect(id, chosen, offered = RANGES) {
  return h("select", { id, title: "time range" },
    offered.map(([value, label]) => h("option", { value, selected: value === chosen }, label)));
}

// Tenant names for the admin's tables (ids when a tenant is not among the first 200).
const tenantNames = new Map();
async function loadTenantNames() {
  const page = await api("/v1/admin/tenants?limit=200");
  for (const t of page.tenants) tenantNames.set(t.tenant_id, t.name);
}
const tenantName = (id) => tenantNames.get(id) || id.slice(0, 8);

function viewRuns(params) {
  const filters = {
    status: params.get("status") || "",
    workflow: params.get("workflow") || "",
    lane: params.get("lane") || "",
    tenant_id: params.get("tenant_id") || "",
  };
  const q = params.get("q") || "";
  const range = params.get("range") || "";
  const cursors = [];  // cursors of the pages before the one shown
  let cursor = params.get("cursor") || null;
  let next = null;
  const status = h("select", { id: "filter-status" }, h("option", { value: "" }, "any status"),
    STATUSES.map((s) => h("option", { value: s, selected: s === filters.status }, s)));
  const search = h("input", { id: "search", type: "search", placeholder: "run id or input text",
    value: q, maxlength: 200 });
  const ranges = rangeSelect("filter-range", range);
  const fields = [h("input", { id: "filter-workflow", placeholder: "workflow", value: filters.workflow })];
  if (session.isAdmin) {
    fields.push(h("input", { id: "filter-lane", placeholder: "lane", value: filters.lane }),
      h("input", { id: "filter-tenant", placeholder: "tenant id", value: filters.tenant_id }));
  }
  const apply = () => {
    const query = new URLSearchParams();
    query.set("status", status.value);
    query.set("workflow", fields[0].value.trim());
    if (session.isAdmin) {
      query.set("lane", fields[1].value.trim());
      query.set("tenant_id", fields[2].value.trim());
    }
    query.set("q", search.value.trim());
    query.set("range", ranges.value);
    for (const [name, value] of [...query]) if (!value) query.delete(name);
    location.hash = `#/runs?${query}`;
  };
  const body = h("tbody", { id: "runs-body" });
  const newer = h("button", { type: "button", disabled: true, onclick: () => {
    cursor = cursors.pop() || null; refresh();
  } }, "← Newer");
  const older = h("button", { type: "button", disabled: true, onclick: () => {
    cursors.push(cursor); cursor = next; refresh();
  } }, "Older →");
  // Columns marked wide are left out on a narrow screen (app.css), so the table fits.
  const columns = [["run"], ["workflow"], session.isAdmin && ["tenant"], ["status"],
    ["lane", "wide"], ["attempt", "wide"], ["age", "num"], ["duration", "num"]].filter(Boolean);
  // Ticked runs stay ticked across refreshes and pages, until a bulk action takes them.
  const selection = new Set();
  let shown = [];
  // The page's filters as a bulk action's body; null where the bulk routes cannot say them
  // (a lane, a search), since "every match" would then reach runs the page does not show.
  const matching = () => {
    if (filters.lane || q) return null;
    const body = {};
    for (const name of ["status", "workflow", "tenant_id"]) if (filters[name]) body[name] = filters[name];
    if (range) body.created_after = new Date(Date.now() - Number(range) * 1000).toISOString();
    return body;
  };
  const bulk = bulkBar(selection, matching, () => refresh());
  const selectAll = selectAllCell(selection, () => shown, () => { bulk.update(); refresh(); });
  main.replaceChildren(h("h1", {}, "Runs"),
    h("form", { class: "row", onsubmit: (e) => { e.preventDefault(); apply(); } },
      search, ranges, status, fields, h("button", { type: "submit" }, "Filter")),
    bulk.element,
    h("table", { id: "runs" }, h("thead", {}, h("tr", {}, selectAll,
      columns.map(([c, cls]) => h("th", { class: cls }, c)))), body),
    h("div", { class: "row" }, newer, older, h("span", { class: "note", id: "runs-note" })));
  status.addEventListener("change", apply);
  ranges.addEventListener("change", apply);
  if (session.isAdmin) loadTenantNames().catch(() => {});

  async function refresh() {
    const query = new URLSearchParams({ limit: "25" });
    for (const [name, value] of Object.entries(filters)) if (value) query.set(name, value);
    if (range) query.set("created_after", new Date(Date.now() - Number(range) * 1000).toISOString());
    if (cursor) query.set("cursor", cursor);
    let page;
    if (q && RUN_ID_PART.test(q)) {
      // Looks like a run id: that run; if none, the word may be in an input after all.
      page = await api(`${runsBase()}?${query}&run_id=${encodeURIComponent(q.toLowerCase())}`);
    }
    if (q && !(page && page.runs.length)) {
      page = await api(`${runsBase()}?${query}&input_contains=${encodeURIComponent(q)}`);
    }
    if (!q) page = await api(`${runsBase()}?${query}`);
    next = page.next_cursor;
    newer.disabled = cursors.length === 0 && !cursor;
    older.disabled = !next;
    shown = page.runs.map((run) => run.run_id);
    body.replaceChildren(...page.runs.map((run) => h("tr", {
      class: "clickable", "data-run-id": run.run_id,
      onclick: () => { location.hash = `#/runs/${run.run_id}`; },
    },
    selectCell(selection, run.run_id, () => bulk.update()),
    h("td", {}, h("a", { href: `#/runs/${run.run_id}` }, h("code", {}, shortRunId(run.run_id)))),
    h("td", {}, run.workflow),
    session.isAdmin && h("td", { title: run.tenant_id }, tenantName(run.tenant_id)),
    h("td", {}, badge(run.status)),
    h("td", { class: "wide" }, run.queue),
    h("td", { class: "num wide" }, run.attempt),
    h("td", { class: "num" }, age(run.created_at)),
    h("td", { class: "num" }, duration(run.elapsed_time)))));
    if (!page.runs.length) {
      body.append(h("tr", {}, h("td", { colspan: columns.length + 1, class: "note" },
        q ? `No runs match “${q}”.` : "No runs.")));
    }
    document.getElementById("runs-note").textContent =
      `${page.runs.length} ${page.runs.length === 1 ? "run" : "runs"} on this page · refreshed ${utc(new Date().toISOString())}`;
  }
  every(POLL_MS, refresh);
}

// One run: its facts, polled; its events, streamed live.
function viewRun(runId) {
  const base = `${runsBase()}/${encodeURIComponent(runId)}`;
  const facts = h("dl", { class: "facts" });
  const title = h("h1", {}, "Run ", h("code", {}, runId));
  const controls = h("div", { class: "row", id: "controls" });
  const interrupt = h("div");
  const io = h("div", { class: "grid2" });
  const timeline = h("div", { class: "panel timeline", id: "steps" });
  const family = h("div", { id: "family" });
  const streamed = h("pre", { class: "stream-text", id: "streamed" });
  const events = h("div", { class: "panel events", id: "events" });
  main.replaceChildren(title, h("div", { class: "panel" }, facts), interrupt, controls, io,
    family, h("h2", {}, "Steps"), timeline, h("h2", {}, "Streamed text"), streamed,
    h("h2", {}, "Events"), events);
  let run = null;

  async function act(path, body, done) {
    try {
      await api(`${base}/${path}`, { method: "POST", body });
      await refresh();
      if (done) done();
    } catch (error) {
      showError(error);
    }
  }

  // A re-run is a new run: its page is where to follow it.
  async function rerun() {
    try {
      const started = await api(`${base}/rerun`, { method: "POST" });
      location.hash = `#/runs/${started.run_id}`;
    } catch (error) {
      showError(error);
    }
  }

  function drawControls() {
    const message = h("input", { id: "message", placeholder: "message to the run" });
    controls.replaceChildren(
      h("button", { id: "cancel", class: "danger", type: "button",
        disabled: TERMINAL.has(run.status), onclick: () => act("cancel") }, "Cancel"),
      // Retry resumes this run at its failed step (its stream reopens: it has not ended now).
      h("button", { id: "retry", type: "button", disabled: !RETRYABLE.has(run.status),
        title: "Queue this run again from the step that failed",
        onclick: () => act("retry", undefined, () => { if (!streaming) streamEvents(); }) }, "Retry"),
      h("button", { id: "rerun", type: "button", title: "Start a new run with the same input",
        onclick: rerun }, "Re-run"),
      h("form", { class: "row", onsubmit: (e) => {
        e.preventDefault();
        if (message.value) act("messages", { content: message.value }, () => { message.value = ""; });
      } }, message, h("button", { type: "submit", disabled: run.status !== "running" }, "Send")));
  }

  function drawInterrupt() {
    const pending = run.pending_interrupt;
    if (!pending) { interrupt.replaceChildren(); return; }
    if (interrupt.dataset.id === pending.interrupt_id) return;
    interrupt.dataset.id = pending.interrupt_id;
    interrupt.replaceChildren(h("div", { class: "panel interrupt", id: "interrupt" },
      h("h2", {}, "Waiting for a decision: ", h("code", {}, pending.action)),
      json(pending.data),
      h("p", { class: "note" }, `Expires ${utc(pending.expires_at)}`),
      h("div", { class: "row" },
        h("button", { id: "approve", class: "approve", type: "button", onclick: () => act("resume",
          { interrupt_id: pending.interrupt_id, approved: true }) }, "Approve"),
        h("button", { id: "deny", class: "deny", type: "button", onclick: () => act("resume",
          { interrupt_id: pending.interrupt_id, approved: false }) }, "Deny"))));
  }

  // Steps and approval waits on one time axis from the run's start: a wait is drawn from
  // the request to the decision (or now), so the time a run spent waiting for a person shows.
  function drawSteps() {
    const approvals = run.approvals || [];
    if (!run.steps.length && !approvals.length) {
      timeline.replaceChildren(h("span", { class: "note" }, "No steps yet."));
      return;
    }
    const rows = [
      ...run.steps.map((s) => ({ key: s.key, cls: s.status, from: s.started_at, to: s.finished_at,
        open: s.status === "running" })),
      ...approvals.map((a) => ({ key: `approval: ${a.action}`, cls: "wait", from: a.requested_at,
        to: a.decided_at, open: a.status === "pending",
        note: a.status === "pending" ? "waiting" : a.reason })),
    ].sort((a, b) => Date.parse(a.from) - Date.parse(b.from));
    const start = Math.min(Date.parse(run.started_at || run.created_at),
      ...rows.map((r) => Date.parse(r.from)));
    const end = Math.max(run.finished_at ? Date.parse(run.finished_at) : Date.now(),
      ...rows.map((r) => (r.to ? Date.parse(r.to) : Date.now())));
    const span = Math.max(1, end - start);
    timeline.replaceChildren(...rows.map((row) => {
      const from = Date.parse(row.from);
      const to = row.to ? Date.parse(row.to) : Date.now();
      const bar = h("div", { class: `bar ${row.cls}`, title: `${utc(row.from)} → ${row.to ? utc(row.to) : "now"}` });
      bar.style.left = `${((from - start) / span) * 100}%`;
      bar.style.width = `${Math.max(0.5, ((to - from) / span) * 100)}%`;
      return h("div", { class: row.cls === "wait" ? "wait-row" : "step" },
        h("code", {}, row.key), h("div", { class: "track" }, bar),
        h("span", { class: "num" }, `${row.open ? "… " : ""}${duration((to - from) / 1000)}`
          + (row.note ? ` (${row.note})` : "")));
    }), h("div", { class: "axis" }, h("span", { class: "note" }, "seconds from start"),
      h("div", { class: "ticks" }, h("span", {}, "0 s"), h("span", {}, duration(span / 2000)),
        h("span", {}, duration(span / 1000))), h("span")));
  }

  async function refresh() {
    run = await api(base);
    title.replaceChildren("Run ", h("code", {}, run.run_id), " ", badge(run.status));
    facts.replaceChildren(...[
      ["workflow", run.workflow],
      ["tenant", session.isAdmin ? `${tenantName(run.tenant_id)} (${run.tenant_id})` : run.tenant_id],
      ["lane", run.queue],
      ["attempts", run.attempt], ["conversation", run.conversation_id || "—"],
      ["created", utc(run.created_at)],
      ["started", utc(run.started_at)],
      ["finished", utc(run.finished_at)],
      ["elapsed", duration(run.elapsed_time)],
      ...(run.usage ? [
        ["tokens", describeTokens(run.usage)],
        ["cost", money(run.usage.cost)],
        ["saved", `${run.usage.saved_tokens} tokens, ${money(run.usage.saved_cost)}`],
      ] : []),
      ...(run.waiting_for ? [["waiting for", describeWait(run.waiting_for)]] : []),
    ].flatMap(([name, value]) => [h("dt", {}, name), h("dd", { "data-fact": name }, String(value))]));
    io.replaceChildren(
      h("div", {}, h("h2", {}, "Input"), json(run.input)),
      h("div", { id: "result" }, h("h2", {}, run.error ? "Error" : "Output"),
        ...(run.error ? errorParts(run.error) : [json(run.output)])));
    drawInterrupt();
    drawControls();
    drawFamily();
    drawSteps();
  }

  // The run's place in its tree: a link up to its parent, and its children with links down.
  // Redrawn only when it changed: every event of the run refreshes the page, and a link
  // replaced between the press and the release of a click swallows the click.
  let familyDrawn = null;
  function drawFamily() {
    const drawn = JSON.stringify([run.parent_run_id, run.rerun_of, run.children]);
    if (drawn === familyDrawn) return;
    familyDrawn = drawn;
    const parts = [];
    if (run.parent_run_id) {
      parts.push(h("p", { id: "parent" }, "Child of ",
        h("a", { href: `#/runs/${run.parent_run_id}` }, h("code", {}, run.parent_run_id))));
    }
    if (run.rerun_of) {
      parts.push(h("p", { id: "rerun-of" }, "Re-run of ",
        h("a", { href: `#/runs/${run.rerun_of}` }, h("code", {}, run.rerun_of))));
    }
    if (run.children && run.children.length) {
      parts.push(h("h2", {}, `Children (${run.children.length})`),
        h("table", { class: "runs", id: "children" },
          h("thead", {}, h("tr", {}, ...["run", "key", "workflow", "status"].map((c) => h("th", {}, c)))),
          h("tbody", {}, ...run.children.map((child) => h("tr", {},
            h("td", {}, h("a", { href: `#/runs/${child.run_id}` }, h("code", {}, shortRunId(child.run_id)))),
            h("td", {}, h("code", {}, child.key)), h("td", {}, child.workflow),
            h("td", {}, badge(child.status)))))));
    }
    family.replaceChildren(...parts);
  }

  const stop = new AbortController();
  onLeave(() => stop.abort());
  let lastId = null;
  let streaming = false;
  const streamEvents = async () => {
    streaming = true;
    try { await followEvents(); } finally { streaming = false; }
  };
  const followEvents = async () => {
    // The stream closes after the terminal event; it is reopened after the last event seen
    // while the run has not ended (a server restart, a proxy timeout, a retry).
    while (!stop.signal.aborted) {
      try {
        await readEvents(`${base}/events`, lastId, (event) => {
          lastId = event.id;
          events.append(h("div", { "data-type": event.type },
            h("span", { class: "note" }, `#${event.id} `), h("span", { class: "type" }, event.type),
            " ", JSON.stringify(event.data)));
          // A model's answer is thousands of deltas: keep the newest lines on the page.
          while (events.childElementCount > MAX_EVENT_LINES) events.firstElementChild.remove();
          events.scrollTop = events.scrollHeight;
          if (event.type === "delta") {
            if (event.data && typeof event.data.text === "string") {
              streamed.textContent += event.data.text;
            }
            return;  // a model streams many: the poll keeps the facts fresh meanwhile
          }
          refresh().catch(() => {});
        }, stop.signal);
      } catch (error) {
        if (stop.signal.aborted) return;
        if (error instanceof ApiError && error.status === 404) return;
        showError(error);
      }
      if (run && TERMINAL.has(run.status)) return;
      await new Promise((resolve) => setTimeout(resolve, 1000));
    }
  };
  refresh().then(() => { streamEvents(); every(POLL_MS, refresh); }).catch((error) => {
    main.replaceChildren(h("h1", {}, "Run not found"),
      h("p", { class: "error", id: "not-found", role: "alert" }, error.message),
      h("a", { href: "#/runs" }, "All runs"));
  });
}

// Tenants: plan, today's quota use against the limit, running runs against the cap.
function viewTenants() {
  const body = h("tbody", { id: "tenants-body" });
  const created = h("div", { id: "created" });
  const name = h("input", { id: "tenant-name", placeholder: "name", required: true });
  const plan = h("input", { id: "tenant-plan", placeholder: "plan", value: "team", required: true });
  main.replaceChildren(h("h1", {}, "Tenants"),
    h("table", { id: "tenants" }, h("thead", {}, h("tr", {},
      ["name", "tenant id", "plan", "lane", "quota today", "", "running", "", "tokens today",
        "cost today"].map((c) => h("th", {}, c)))),
    body),
    h("h2", {}, "New tenant"),
    h("form", { class: "row", onsubmit: async (event) => {
      event.preventDefault();
      try {
        const tenant = await api("/v1/admin/tenants", {
          method: "POST", body: { name: name.value.trim(), plan: plan.value.trim() },
        });
        name.value = "";
        created.replaceChildren(h("div", { class: "panel" },
          h("p", {}, `Tenant ${tenant.name} created. Its API key is shown this once:`),
          h("pre", { id: "new-key" }, tenant.api_key)));
      } catch (error) { showError(error); }
    } }, name, plan, h("button", { type: "submit" }, "Create")),
    created);
  every(POLL_MS * 2, async () => {
    const page = await api("/v1/admin/tenants?limit=200");
    body.replaceChildren(...page.tenants.map((t) => h("tr", { "data-tenant-id": t.tenant_id },
      h("td", {}, t.name), h("td", {}, h("code", {}, t.tenant_id.slice(0, 8))),
      h("td", {}, t.plan), h("td", {}, t.lane),
      h("td", { class: "num" }, `${t.used_today} / ${t.daily_quota}`),
      h("td", {}, meter(t.used_today, t.daily_quota)),
      h("td", { class: "num" }, `${t.running} / ${t.tenant_concurrency}`),
      h("td", {}, meter(t.running, t.tenant_concurrency)),
      h("td", { class: "num" }, String(t.tokens_today)),
      h("td", { class: "num" }, money(t.cost_today)))));
  });
}

// A run's or a day's LLM tokens: "prompt + completion (cached)".
function describeTokens(u) {
  return `${u.prompt_tokens} prompt + ${u.completion_tokens} completion (${u.cached_tokens} cached)`;
}

// A cost as the models file prices it (its currency is the file's).
function money(value) { return (value || 0).toFixed(6); }

// Usage (a tenant's own): its daily quota, and its LLM tokens and cost today by model/workflow.
function viewUsage() {
  const box = h("div", { class: "panel" });
  const tables = h("div", { id: "llm-usage" });
  main.replaceChildren(h("h1", {}, "Usage"), box, tables);
  const breakdown = (title, rows) => h("div", {}, h("h2", {}, title),
    h("table", {}, h("thead", {}, h("tr", {},
      [title === "By model" ? "model" : "workflow", "requests", "tokens", "cost", "saved tokens"]
        .map((c) => h("th", {}, c)))),
    h("tbody", {}, ...Object.entries(rows).map(([name, u]) => h("tr", {},
      h("td", {}, name), h("td", { class: "num" }, String(u.requests)),
      h("td", {}, describeTokens(u)), h("td", { class: "num" }, money(u.cost)),
      h("td", { class: "num" }, String(u.saved_tokens)))))));
  every(POLL_MS * 2, async () => {
    const usage = await api("/v1/usage");
    box.replaceChildren(h("dl", { class: "facts" },
      h("dt", {}, "plan"), h("dd", {}, usage.plan),
      h("dt", {}, "quota today"), h("dd", {}, `${usage.used_today} / ${usage.daily_quota}`,
        meter(usage.used_today, usage.daily_quota)),
      h("dt", {}, "resets"), h("dd", {}, utc(usage.resets_at)),
      h("dt", {}, "LLM tokens today"), h("dd", { "data-fact": "tokens" }, String(usage.tokens_today)),
      h("dt", {}, "LLM cost today"), h("dd", { "data-fact": "cost" }, money(usage.cost_today)),
      h("dt", {}, "saved by replays"),
      h("dd", {}, `${usage.saved_tokens_today} tokens, ${money(usage.saved_cost_today)}`)));
    tables.replaceChildren(breakdown("By model", usage.by_model),
      breakdown("By workflow", usage.by_workflow));
  });
}

// Schedules (a tenant's own): when each fires next, what its ticks did; pause, resume, delete.
function viewSchedules() {
  const body = h("tbody", { id: "schedules-body" });
  main.replaceChildren(h("h1", {}, "Schedules"),
    h("table", { id: "schedules" }, h("thead", {}, h("tr", {},
      ["schedule", "workflow", "when", "next tick", "last fired", "fired", "refused",
        "last refusal", ""].map((c) => h("th", {}, c)))),
    body));
  async function act(schedule, action) {
    try {
      if (action === "delete") {
        await api(`/v1/schedules/${encodeURIComponent(schedule.schedule_id)}`, { method: "DELETE" });
      } else {
        await api(`/v1/schedules/${encodeURIComponent(schedule.schedule_id)}/${action}`,
          { method: "POST" });
      }
      await refresh();
    } catch (error) { showError(error); }
  }
  async function refresh() {
    const { schedules } = await api("/v1/schedules");
    body.replaceChildren(...schedules.map((s) => h("tr", { "data-schedule-id": s.schedule_id },
      h("td", {}, h("code", {}, s.schedule_id.slice(0, 8))),
      h("td", {}, s.workflow),
      h("td", {}, s.cron ? `${s.cron} (${s.timezone})` : `every ${s.every_seconds} s`),
      h("td", { class: "state" }, s.paused ? "paused" : utc(s.next_at)),
      h("td", {}, s.last_run_id
        ? h("a", { href: `#/runs/${encodeURIComponent(s.last_run_id)}` }, `${age(s.last_fired_at)} ago`)
        : "—"),
      h("td", { class: "num" }, String(s.fired_count)),
      h("td", { class: "num" }, String(s.refused_count)),
      h("td", {}, s.last_error ? `${s.last_error.code}: ${s.last_error.message}` : "—"),
      h("td", {},
        h("button", { type: "button", onclick: () => act(s, s.paused ? "resume" : "pause") },
          s.paused ? "Resume" : "Pause"),
        h("button", { type: "button", onclick: () => act(s, "delete") }, "Delete")))));
  }
  every(POLL_MS * 2, refresh);
}

// A page of the other role: say so, rather than showing another page in its place.
function viewForbidden(page, role) {
  const who = session.isAdmin ? "the admin" : "a tenant";
  main.replaceChildren(h("h1", {}, `${page}: not for this sign-in`),
    h("p", { class: "error", id: "forbidden", role: "alert" },
      `The ${page} page is for ${role === "admin" ? "the admin" : "a tenant's API key"}; `
      + `you are signed in as ${who}.`),
    h("a", { href: "#/runs" }, "Runs"));
}

// ---- routing ----------------------------------------------------------------------------

function route() {
  for (const stop of cleanups) stop();
  cleanups = [];
  const [path, query] = location.hash.slice(1).split("?");
  const params = new URLSearchParams(query || "");
  const signedIn = Boolean(session.token);
  document.getElementById("nav").hidden = !signedIn;
  document.getElementById("sign-out").hidden = !signedIn;
  document.getElementById("who").textContent = signedIn
    ? `signed in as ${sessionStorage.getItem("moorline.label")}` : "";
  for (const link of document.querySelectorAll("#nav a")) {
    link.hidden = Boolean(link.dataset.role) && link.dataset.role !== session.role;
    link.classList.toggle("active", path.startsWith(`/${link.dataset.page}`));
  }
  if (!signedIn) { viewSignIn(); return; }
  const parts = path.split("/").filter(Boolean);
  const link = document.querySelector(`#nav a[data-page="${CSS.escape(parts[0] || "")}"]`);
  if (link && link.dataset.role && link.dataset.role !== session.role) {
    viewForbidden(link.textContent, link.dataset.role);
    return;
  }
  if (parts[0] === "runs" && parts[1]) viewRun(decodeURIComponent(parts[1]));
  else if (parts[0] === "stats") viewStats(params);
  else if (parts[0] === "lanes" && session.isAdmin) viewLanes();
  else if (parts[0] === "workers" && parts[1] && session.isAdmin) {
    viewWorker(decodeURIComponent(parts[1]));
  } else if (parts[0] === "workers" && session.isAdmin) viewWorkers();
  else if (parts[0] === "tenants" && session.isAdmin) viewTenants();
  else if (parts[0] === "usage" && !session.isAdmin) viewUsage();
  else if (parts[0] === "schedules" && !session.isAdmin) viewSchedules();
  else viewRuns(params);
}

document.getElementById("sign-out").addEventListener("click", signOut);
window.addEventListener("hashchange", route);
route();
