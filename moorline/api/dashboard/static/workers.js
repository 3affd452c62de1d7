// Moorline dashboard: the Workers page (admin), over GET /v1/admin/workers.
//
// Loaded before app.js (both deferred, so in order) and called by its router: the helpers it
// uses (h, api, every, badge, age, duration, onLeave) are app.js's, defined by the time a view
// is drawn. A separate file keeps app.js to the pages it had.
"use strict";

const HELD_SHOWN = 8;  // held run links per row; the rest are counted, and listed on the worker

// Every worker process, live ones first: its lanes with their slots, what it serves, and the
// runs it holds (links to each). A worker that sent no heartbeat for one lease TTL is dead;
// its runs stay listed under it until the reaper takes them back.
function viewWorkers() {
  const body = h("tbody", { id: "workers-body" });
  const note = h("p", { class: "note", id: "workers-note" });
  main.replaceChildren(h("h1", {}, "Workers"),
    h("table", { id: "workers" }, h("thead", {}, h("tr", {},
      ["worker", "status", "host", "pid", "version", "lanes", "workflows", "runs held",
        "last seen"].map((c) => h("th", {}, c)))),
    body),
    note);
  every(POLL_MS, async () => {
    const { workers } = await api("/v1/admin/workers");
    const live = workers.filter((w) => w.status === "live").length;
    note.textContent = `${live} live, ${workers.length - live} dead. A worker is dead after one `
      + "lease TTL without a heartbeat; one that stops cleanly leaves the list.";
    if (!workers.length) {
      body.replaceChildren(h("tr", {}, h("td", { colspan: 9, class: "note" }, "No workers.")));
      return;
    }
    body.replaceChildren(...workers.map((w) => h("tr", {
      "data-worker-id": w.worker_id, "data-status": w.status, class: w.status,
    },
    h("td", {}, h("a", { href: `#/workers/${encodeURIComponent(w.worker_id)}` },
      h("code", {}, w.worker_id))),
    h("td", {}, badge(w.status)),
    h("td", {}, w.host), h("td", { class: "num" }, w.pid), h("td", {}, w.version || "—"),
    h("td", { class: "lanes" }, lanesText(w.lanes)),
    h("td", {}, w.workflows === null ? "all" : w.workflows.join(", ")),
    h("td", { class: "held" }, heldLinks(w)),
    h("td", { class: "num" }, `${duration(w.last_seen_age_s)} ago`))));
  });
}

const lanesText = (lanes) => Object.entries(lanes).sort()
  .map(([lane, slots]) => `${lane}=${slots}`).join(", ");

function heldLinks(worker) {
  const links = worker.run_ids.slice(0, HELD_SHOWN).map((id) => h("a", {
    href: `#/runs/${id}`, "data-run-id": id,
  }, h("code", {}, id.slice(0, 8))));
  const more = worker.runs - links.length;
  return [h("b", { class: "count" }, worker.runs), " ", ...links.flatMap((link) => [link, " "]),
    more > 0 ? h("span", { class: "note" }, `+${more} more`) : null];
}

// One worker: its facts and every run it holds.
function viewWorker(workerId) {
  const title = h("h1", {}, "Worker ", h("code", {}, workerId));
  const facts = h("dl", { class: "facts panel", id: "worker-facts" });
  const body = h("tbody", { id: "held-body" });
  main.replaceChildren(title, facts, h("h2", {}, "Runs held"),
    h("table", { class: "runs", id: "held" }, h("thead", {}, h("tr", {},
      ["run", "workflow", "lane", "tenant", "attempt", "running for", "lease expires"]
        .map((c) => h("th", {}, c)))), body),
    h("p", {}, h("a", { href: "#/workers" }, "All workers")));
  every(POLL_MS, async () => {
    let w;
    try {
      w = await api(`/v1/admin/workers/${encodeURIComponent(workerId)}`);
    } catch (error) {
      if (error.status !== 404) throw error;
      facts.replaceChildren(h("p", { class: "error", id: "not-found" }, error.message));
      body.replaceChildren();
      return;
    }
    title.replaceChildren("Worker ", h("code", {}, w.worker_id), " ", badge(w.status));
    facts.replaceChildren(...[
      ["host", w.host], ["pid", w.pid], ["version", w.version || "—"],
      ["lanes", lanesText(w.lanes)],
      ["workflows", w.workflows === null ? "all" : w.workflows.join(", ")],
      ["started", utc(w.started_at)],
      ["last seen", `${duration(w.last_seen_age_s)} ago`], ["runs held", w.runs],
    ].flatMap(([name, value]) => [h("dt", {}, name), h("dd", { "data-fact": name }, String(value))]));
    body.replaceChildren(...(w.held.length ? w.held.map((run) => h("tr", {
      class: "clickable", "data-run-id": run.run_id,
      onclick: () => { location.hash = `#/runs/${run.run_id}`; },
    },
    h("td", {}, h("code", {}, run.run_id)), h("td", {}, run.workflow), h("td", {}, run.queue),
    h("td", {}, h("code", {}, run.tenant_id.slice(0, 8))), h("td", { class: "num" }, run.attempt),
    h("td", {}, age(run.started_at)),
    h("td", {}, utc(run.lease_expires_at))))
      : [h("tr", {}, h("td", { colspan: 7, class: "note" }, "It holds no run."))]));
  });
}
