// Moorline dashboard: the Statistics page, over GET /v1/stats/workflows (a tenant's runs) or
// GET /v1/admin/stats/workflows (every tenant's).
//
// Loaded before app.js like workers.js, and called by its router; it uses app.js's helpers
// (h, svg, api, every, duration, utc, rangeSelect, session, main), defined by the time a view
// is drawn.
"use strict";

// The ranges offered, in seconds back from now; runs count by when they ended.
const STATS_RANGES = [["900", "last 15 min"], ["3600", "last hour"], ["86400", "last 24 h"],
  ["604800", "last 7 days"]];

const percent = (share) => (share === null ? "—" : `${(share * 100).toFixed(1)} %`);

function viewStats(params) {
  const range = params.get("range") || "3600";
  const chosen = rangeSelect("stats-range", range, STATS_RANGES);
  const body = h("tbody", { id: "stats-body" });
  const chart = h("div", { id: "stats-chart" });
  const note = h("p", { class: "note", id: "stats-note" });
  const columns = [["workflow"], ["ended", "num"], ["runs / min", "num"], ["failure rate", "num"],
    ["p50", "num"], ["p95", "num"], ["by status", "wide"]];
  main.replaceChildren(h("h1", {}, "Statistics"),
    h("div", { class: "row" }, h("label", { for: "stats-range" }, "Runs that ended in the"), chosen),
    h("table", { id: "stats" }, h("thead", {}, h("tr", {},
      columns.map(([c, cls]) => h("th", { class: cls }, c)))), body),
    chart, note);
  chosen.addEventListener("change", () => { location.hash = `#/stats?range=${chosen.value}`; });
  const base = session.isAdmin ? "/v1/admin/stats/workflows" : "/v1/stats/workflows";
  every(POLL_MS * 5, async () => {
    const until = new Date();
    const since = new Date(until.getTime() - Number(range) * 1000);
    const query = new URLSearchParams({ since: since.toISOString(), until: until.toISOString() });
    const stats = await api(`${base}?${query}`);
    body.replaceChildren(...stats.workflows.map((w) => h("tr", { "data-workflow": w.workflow },
      h("td", {}, w.workflow),
      h("td", { class: "num", "data-stat": "ended" }, String(w.ended)),
      h("td", { class: "num", "data-stat": "rate" }, w.runs_per_minute.toFixed(2)),
      h("td", { class: "num", "data-stat": "failure" }, percent(w.failure_rate)),
      h("td", { class: "num", "data-stat": "p50" }, duration(w.p50_seconds)),
      h("td", { class: "num", "data-stat": "p95" }, duration(w.p95_seconds)),
      h("td", { class: "wide" }, Object.entries(w.by_status).map(([status, n]) => `${status} ${n}`)
        .join(" · ")))));
    if (!stats.workflows.length) {
      body.append(h("tr", {}, h("td", { colspan: columns.length, class: "note" },
        "No run ended in this range.")));
    }
    chart.replaceChildren(stats.workflows.length ? rateChart(stats.workflows) : "");
    note.textContent = `From ${utc(stats.since)} to ${utc(stats.until)}. Failure rate: failed and `
      + "timed out runs over all that ended. p50/p95: seconds from first start to end of the "
      + "succeeded and failed ones" + (stats.workflows.some((w) => w.sampled)
      ? " (from the newest 20,000 only)." : ".");
  });
}

// Runs per minute of each workflow as bars, with both axes labelled and the unit written.
function rateChart(workflows) {
  const left = 90;
  const row = 18;
  const width = 300;
  const height = workflows.length * row;
  const top = Math.max(...workflows.map((w) => w.runs_per_minute), 0.01);
  const chart = svg("svg", {
    class: "chart", id: "stats-rate-chart", width: "100%", height: height + 30,
    viewBox: `0 0 ${left + width + 60} ${height + 30}`, preserveAspectRatio: "xMinYMin meet",
    role: "img", "aria-label": "runs per minute by workflow",
  });
  const text = (x, y, content, anchor = "start") => {
    const node = svg("text", { x, y, "font-size": 10, fill: "#66707c", "text-anchor": anchor });
    node.textContent = content;
    chart.append(node);
  };
  workflows.forEach((w, index) => {
    const y = index * row;
    const bar = svg("rect", { x: left, y: y + 3, height: row - 6,
      width: Math.max(1, (w.runs_per_minute / top) * width) });
    bar.append(svg("title"));
    bar.firstChild.textContent = `${w.workflow}: ${w.runs_per_minute.toFixed(2)} runs / min`;
    chart.append(bar);
    const name = w.workflow.length > 14 ? `${w.workflow.slice(0, 13)}…` : w.workflow;
    text(left - 4, y + row - 6, name, "end");
  });
  chart.append(svg("line", { x1: left, x2: left, y1: 0, y2: height }));
  chart.append(svg("line", { x1: left, x2: left + width, y1: height, y2: height }));
  text(left, height + 12, "0");
  text(left + width, height + 12, top.toFixed(2), "end");
  text(left + width / 2, height + 26, "runs / min", "middle");
  return chart;
}
