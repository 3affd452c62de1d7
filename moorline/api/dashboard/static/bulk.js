// Moorline dashboard: bulk cancel and retry from the Runs page, over POST …/runs/bulk/{action}.
//
// Loaded before app.js, like workers.js: the helpers it uses (h, api, runsBase, showError,
// onLeave) are app.js's, defined by the time a view is drawn. The Runs page keeps a selection
// across its refreshes and asks this file for a checkbox per row and for the bar that acts on
// the selection, or on every run its filters match. A job is followed until it is finished,
// with its progress; a new idempotency key per click makes a double click start one job.
"use strict";

const BULK_POLL_MS = 500;

// The checkbox cell of one row; a click on it selects, it does not open the run.
function selectCell(selection, runId, changed) {
  const box = h("input", {
    type: "checkbox", class: "select-run", "data-run-id": runId,
    "aria-label": `select run ${runId}`, checked: selection.has(runId),
    onclick: (event) => event.stopPropagation(),
    onchange: () => {
      if (box.checked) selection.add(runId); else selection.delete(runId);
      changed();
    },
  });
  return h("td", { class: "select", onclick: (event) => event.stopPropagation() }, box);
}

// The header's checkbox: selects (or clears) every run of the page shown.
function selectAllCell(selection, shownIds, changed) {
  const box = h("input", {
    type: "checkbox", id: "select-page", "aria-label": "select every run of this page",
    onchange: () => {
      for (const runId of shownIds()) {
        if (box.checked) selection.add(runId); else selection.delete(runId);
      }
      changed();
    },
  });
  return h("th", { class: "select" }, box);
}

// The bar above the table. `matching()` gives the page's filters as a bulk body, or null when
// a filter the bulk routes lack (the lane, a search) is set: acting on "every match" would then
// reach runs the page does not show.
function bulkBar(selection, matching, acted) {
  const count = h("span", { id: "bulk-count", class: "note" });
  const progress = h("span", { id: "bulk-progress", class: "note" });
  const bar = h("progress", { id: "bulk-bar", max: 1, value: 0, hidden: true });
  const buttons = {
    cancelSelected: h("button", { id: "bulk-cancel", class: "danger", type: "button" }, "Cancel selected"),
    retrySelected: h("button", { id: "bulk-retry", type: "button" }, "Retry selected"),
    cancelMatching: h("button", { id: "bulk-cancel-matching", type: "button" }, "Cancel all matching"),
    retryMatching: h("button", { id: "bulk-retry-matching", type: "button" }, "Retry all matching"),
  };
  let following = null;

  async function start(action, body, what) {
    if (!confirm(`${action === "cancel" ? "Cancel" : "Retry"} ${what}?`)) return;
    try {
      const job = await api(`${runsBase()}/bulk/${action}`, {
        method: "POST", body: { ...body, idempotency_key: crypto.randomUUID() },
      });
      selection.clear();
      update();
      follow(job);
    } catch (error) {
      showError(error);
    }
  }

  function show(job) {
    const handled = job.done + job.failed;
    bar.hidden = false;
    bar.max = Math.max(1, job.total);
    bar.value = handled;
    const verb = job.action === "cancel" ? "cancelled" : "retried";
    progress.textContent = `${job.action} job ${job.job_id.slice(0, 8)}: ${job.done} ${verb}, `
      + `${job.failed} no longer applicable, of ${job.total}`
      + (job.state === "finished" ? " · finished" : " · running");
    progress.dataset.state = job.state;
  }

  function follow(job) {
    if (following) clearInterval(following);
    show(job);
    if (job.state === "finished") { acted(); return; }
    following = setInterval(async () => {
      try {
        const now = await api(`${runsBase()}/bulk/${encodeURIComponent(job.job_id)}`);
        show(now);
        if (now.state === "finished") {
          clearInterval(following);
          following = null;
          acted();
        }
      } catch (error) {
        clearInterval(following);
        following = null;
        showError(error);
      }
    }, BULK_POLL_MS);
  }
  onLeave(() => { if (following) clearInterval(following); });

  function update() {
    const n = selection.size;
    count.textContent = n ? `${n} selected` : "none selected";
    buttons.cancelSelected.disabled = buttons.retrySelected.disabled = n === 0;
    const filters = matching();
    buttons.cancelMatching.disabled = buttons.retryMatching.disabled = filters === null;
    const why = filters === null ? "Not with a lane filter or a search: bulk actions filter "
      + "by status, workflow, tenant and time" : "Every run the filters above match, on every page";
    buttons.cancelMatching.title = buttons.retryMatching.title = why;
  }

  const ids = () => ({ ids: [...selection] });
  buttons.cancelSelected.onclick = () => start("cancel", ids(), `${selection.size} selected runs`);
  buttons.retrySelected.onclick = () => start("retry", ids(), `${selection.size} selected runs`);
  buttons.cancelMatching.onclick = () => start("cancel", matching(), "every run that matches the filters");
  buttons.retryMatching.onclick = () => start("retry", matching(), "every failed run that matches the filters");
  update();
  const element = h("div", { class: "row", id: "bulk" }, count, buttons.cancelSelected,
    buttons.retrySelected, buttons.cancelMatching, buttons.retryMatching, bar, progress);
  return { element, update };
}
