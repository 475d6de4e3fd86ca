// The script of the harness's report pages (matrix.html, compare.html), inlined into each: filters,
// permalinks (#cell-...), keyboard moves in the heatmap, a cell's panel and a failing cell's
// timeline, drawn from the page's own data (<script type="application/json" id="harness-data">).
// Nothing is fetched. Every part does nothing on a page that lacks its elements.
(function () {
  "use strict";
  var SVG = "http://www.w3.org/2000/svg";
  var dataElement = document.getElementById("harness-data");
  var data = dataElement ? JSON.parse(dataElement.textContent) : {};
  // cells in short: i id, c case (index into data.cases), v variant, w world size, s status,
  // m summary, e evidence, f failure messages, n more failures, r rerun line, t timeline
  var cells = {};
  (data.cells || []).forEach(function (cell) { cells[cell.i] = cell; });
  // a heatmap square carries only its id: its status, case and world size come from the data
  document.querySelectorAll("#heatmap a.m").forEach(function (mark) {
    var cell = cells[mark.id];
    if (!cell) return;
    mark.dataset.status = cell.s;
    mark.dataset.case = data.cases[cell.c];
    mark.dataset.ws = String(cell.w);
  });
  var kinds = data.kinds || [], coloured = data.coloured || 0;
  var checks = data.checks || [], checkWords = data.check_words || {};

  function el(tag, attrs, text) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (key) { node.setAttribute(key, attrs[key]); });
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function svg(tag, attrs, title) {
    var node = document.createElementNS(SVG, tag);
    Object.keys(attrs || {}).forEach(function (key) { node.setAttribute(key, attrs[key]); });
    if (title) {
      var t = document.createElementNS(SVG, "title");
      t.textContent = title;
      node.appendChild(t);
    }
    return node;
  }

  function kindClass(kind) {
    if (kind < 0) return "k-agreed";
    return kind < coloured ? "k-" + kinds[kind] : "k-other";
  }

  function stepWords(step) {
    if (step[0] === 0) return "before the first step";
    var words = "step " + step[0];
    if (step[1] !== null && step[2] !== null) words += " (epoch " + step[1] + ", batch " + step[2] + ")";
    return words;
  }

  // A failing cell's timeline: micro-steps across, ranks down; in each (rank, step) one mark per
  // kind of check, coloured by its diagnosis; sync points (dots), optimizer steps (dashed lines
  // after the step) and epochs (solid lines) from the schedule. Steps: [step, epoch, batch, sync,
  // optimizer step]; marks: [rank, step, check, kind] (check and kind index data.checks and
  // data.kinds, kind -1 where the check agreed with the oracle).
  function drawTimeline(timeline) {
    var steps = timeline.s, marks = timeline.m;
    var ranks = [], present = [], seenRank = {}, seenCheck = {};
    marks.forEach(function (m) {
      if (!seenRank[m[0]]) { seenRank[m[0]] = true; ranks.push(m[0]); }
      if (!seenCheck[m[2]]) { seenCheck[m[2]] = true; present.push(m[2]); }
    });
    ranks.sort(function (a, b) { return a - b; });
    present.sort(function (a, b) { return a - b; });
    var markW = 10, markH = 17, pad = 4, rowH = 24, left = 56, top = 42;
    var colW = Math.max(22, present.length * markW + 2 * pad);
    var width = left + steps.length * colW + 8, height = top + ranks.length * rowH + 6;
    var root = svg("svg", {
      width: width, height: height, viewBox: "0 0 " + width + " " + height, role: "img",
      "class": "timeline-svg", "aria-label": "timeline: " + steps.length + " micro-steps, " + ranks.length + " ranks"
    });
    var column = {};
    steps.forEach(function (step, i) {
      var x = left + i * colW;
      column[step[0]] = x;
      root.appendChild(svg("text", { x: x + colW / 2, y: 11, "text-anchor": "middle" }, stepWords(step)))
        .appendChild(document.createTextNode(step[0] === 0 ? "·" : String(step[0])));
      if (i > 0 && step[1] !== null && steps[i - 1][1] !== null && step[1] !== steps[i - 1][1]) {
        root.appendChild(svg("line", { x1: x, x2: x, y1: 2, y2: height - 2, stroke: "#1f2328", "stroke-width": 2,
          "class": "epoch" }, "epoch " + step[1] + " begins"));
      }
      if (step[3] === true) {
        root.appendChild(svg("circle", { cx: x + colW / 2, cy: 24, r: 4, fill: "#0969da", "class": "sync" },
          stepWords(step) + ": a sync point (the gradients are averaged across the ranks)"));
      }
      if (step[4] === true) {
        root.appendChild(svg("line", { x1: x + colW - 1, x2: x + colW - 1, y1: 30, y2: height - 2, stroke: "#1f2328",
          "stroke-dasharray": "3,2", "class": "optimizer-step" }, stepWords(step) + ": the optimizer steps"));
        root.appendChild(svg("text", { x: x + colW - 3, y: 38, "text-anchor": "end" }, "optimizer step"))
          .appendChild(document.createTextNode("opt"));
      }
    });
    ranks.forEach(function (rank, r) {
      root.appendChild(svg("text", { x: 2, y: top + r * rowH + 15 })).appendChild(document.createTextNode("rank " + rank));
    });
    var stepOf = {};
    steps.forEach(function (step) { stepOf[step[0]] = step; });
    marks.forEach(function (m) {
      var x = column[m[1]];
      if (x === undefined) return;
      var r = ranks.indexOf(m[0]), c = present.indexOf(m[2]);
      var check = checks[m[2]], kind = m[3] < 0 ? "" : kinds[m[3]];
      var verdict = kind || "agreed with the oracle";
      root.appendChild(svg("rect", {
        x: x + pad + c * markW, y: top + r * rowH + 3, width: markW - 1, height: markH, rx: 1,
        "class": "check " + kindClass(m[3]), "data-rank": m[0], "data-step": m[1], "data-check": check,
        "data-kind": kind
      }, "rank " + m[0] + ", " + stepWords(stepOf[m[1]] || [m[1], null, null]) + ", " +
        (checkWords[check] || check) + ": " + verdict));
    });
    var box = el("div", { "class": "timeline-box" });
    box.appendChild(root);
    var order = present.map(function (c) { return checkWords[checks[c]] || checks[c]; }).join(", ");
    box.appendChild(el("p", { "class": "muted" }, "In each step, left to right: " + order +
      ". Dots: sync points; dashed lines: optimizer steps; solid lines: a new epoch. Hover a mark for what it is."));
    return box;
  }

  function fillTimeline(container, cellId) {
    var cell = cells[cellId];
    if (!container || !cell || !cell.t || container.querySelector("svg")) return;
    container.appendChild(drawTimeline(cell.t));
  }

  // The panel: everything the page has of one cell, opened by its permalink.
  var panel = document.getElementById("panel");
  var selected = null;

  function failureEntry(id) {
    var found = null;
    document.querySelectorAll("details.failure").forEach(function (entry) {
      if (entry.dataset.cell === id) found = entry;
    });
    return found;
  }

  function showCell(id) {
    var cell = cells[id];
    if (!panel || !cell) return false;
    panel.textContent = "";
    var head = el("h2");
    head.appendChild(el("span", { "class": "badge s-" + cell.s }, cell.s));
    head.appendChild(document.createTextNode(" " + data.cases[cell.c] + " · " + cell.v + " · ws=" + cell.w));
    head.appendChild(el("a", { "class": "permalink", href: "#" + id, title: "permalink to this cell" }, "¶"));
    var close = el("button", { type: "button", "class": "close", title: "close (Escape)" }, "close");
    close.addEventListener("click", closePanel);
    head.appendChild(document.createTextNode(" "));
    head.appendChild(close);
    panel.appendChild(head);
    var ev = cell.e || [];
    panel.appendChild(el("p", { "class": "muted" }, ev[0] + " checks (" + ev[1] + " of gradients, " + ev[2] +
      " of them vacuous; " + ev[3] + " backwards' collectives), " + ev[4] + " s"));
    var entry = failureEntry(id);
    if (entry) {  // a bad cell: its entry under Failures has the messages; show a copy
      var copy = entry.querySelector(".body").cloneNode(true);
      copy.querySelectorAll(".timeline").forEach(function (t) { t.textContent = ""; });
      panel.appendChild(copy);
    } else {
      if (cell.m) panel.appendChild(el("p", {}, cell.m));
      if (cell.t) panel.appendChild(el("div", { "class": "timeline" }));
      (cell.f || []).forEach(function (message) { panel.appendChild(el("pre", {}, message)); });
      if (cell.n) panel.appendChild(el("p", { "class": "muted" }, "… and " + cell.n + " more failures in matrix.json"));
      if (cell.r) {
        var p = el("p", {}, "rerun: ");
        p.appendChild(el("code", {}, cell.r));
        panel.appendChild(p);
      }
    }
    fillTimeline(panel.querySelector(".timeline"), id);
    panel.hidden = false;
    if (selected) selected.classList.remove("sel");
    selected = document.getElementById(id);
    if (selected) {
      selected.classList.add("sel");
      rove(selected);
    }
    return true;
  }

  function closePanel() {
    if (!panel) return;
    panel.hidden = true;
    var back = selected;
    if (selected) selected.classList.remove("sel");
    selected = null;
    if (location.hash) history.replaceState(null, "", location.pathname + location.search);
    if (back) back.focus();
  }

  function fromHash(event, where) {
    // the fragment as written is the id (its parts are percent-encoded); a browser or a person
    // may have decoded it once more
    var id = location.hash.slice(1);
    if (!cells[id]) {
      try { id = decodeURIComponent(id); } catch (e) { return; }
    }
    if (id.indexOf("cell-") !== 0) return;
    if (showCell(id)) focusPanel(where);
  }

  // block "nearest" within the page (a square chosen here: the heatmap stays in view); "start" for a
  // page opened at a permalink, so that the panel's heading is at the top and the panel below it
  function focusPanel(where) {
    panel.scrollIntoView({ block: where || "nearest" });
    panel.focus({ preventScroll: true });
  }

  // Filters: by status, case and world size, over the heatmap and the failures.
  var filters = document.getElementById("filters");
  function wanted(node) {
    var statuses = {};
    filters.querySelectorAll('input[name="status"]').forEach(function (box) { statuses[box.value] = box.checked; });
    var caseValue = document.getElementById("filter-case").value;
    var wsValue = document.getElementById("filter-ws").value;
    return statuses[node.dataset.status] !== false && (!caseValue || node.dataset.case === caseValue) &&
      (!wsValue || node.dataset.ws === wsValue);
  }

  function applyFilters() {
    if (!filters) return;
    var marks = document.querySelectorAll("#heatmap a.m"), shown = 0;
    marks.forEach(function (mark) {
      mark.hidden = !wanted(mark);
      if (!mark.hidden) shown += 1;
    });
    var caseValue = document.getElementById("filter-case").value;
    document.querySelectorAll("#heatmap .card").forEach(function (card) {
      card.hidden = Boolean(caseValue) && card.dataset.case !== caseValue;
    });
    document.querySelectorAll("#failures details.failure").forEach(function (entry) { entry.hidden = !wanted(entry); });
    document.querySelectorAll("#failures .group").forEach(function (group) {
      group.hidden = !group.querySelector("details.failure:not([hidden])");
    });
    document.querySelectorAll("[data-filtered]").forEach(function (row) { row.hidden = !wanted(row); });
    var counter = document.getElementById("shown");
    if (counter) counter.textContent = "showing " + shown + " of " + marks.length + " cells";
  }

  if (filters) {
    filters.addEventListener("change", applyFilters);
    document.getElementById("filter-reset").addEventListener("click", function () {
      filters.querySelectorAll('input[name="status"]').forEach(function (box) { box.checked = true; });
      document.getElementById("filter-case").value = "";
      document.getElementById("filter-ws").value = "";
      applyFilters();
    });
    document.querySelectorAll("[data-only-status]").forEach(function (button) {
      button.addEventListener("click", function () {
        filters.querySelectorAll('input[name="status"]').forEach(function (box) {
          box.checked = box.value === button.dataset.onlyStatus;
        });
        applyFilters();
        var heatmap = document.getElementById("matrix");
        if (heatmap) heatmap.scrollIntoView({ block: "start" });
      });
    });
    applyFilters();
  }

  // The heatmap by keyboard: one square in the tab order (roving), the arrow keys move between
  // the visible squares (left/right in reading order, up/down to the nearest square of the row
  // above or below), Enter opens the cell, Escape closes it.
  var heatmap = document.getElementById("heatmap");
  function visibleMarks() {
    return Array.prototype.filter.call(heatmap.querySelectorAll("a.m"), function (m) {
      return !m.hidden && m.offsetParent !== null;
    });
  }
  function rove(target) {
    if (!heatmap) return;
    heatmap.querySelectorAll('a.m[tabindex="0"]').forEach(function (m) { m.setAttribute("tabindex", "-1"); });
    target.setAttribute("tabindex", "0");
  }
  function nearestInRow(marks, from, direction) {
    var here = from.getBoundingClientRect(), best = null, bestRow = null, bestDx = Infinity;
    marks.forEach(function (m) {
      var r = m.getBoundingClientRect();
      var dy = (r.top - here.top) * direction;
      if (dy < 4) return;
      if (bestRow === null || dy < bestRow - 4) { bestRow = dy; best = null; bestDx = Infinity; }
      if (Math.abs(dy - bestRow) > 4) return;
      var dx = Math.abs(r.left - here.left);
      if (dx < bestDx) { bestDx = dx; best = m; }
    });
    return best;
  }
  if (heatmap) {
    heatmap.querySelectorAll("a.m").forEach(function (m, i) { m.setAttribute("tabindex", i === 0 ? "0" : "-1"); });
    heatmap.addEventListener("keydown", function (event) {
      var current = event.target;
      if (!current.classList || !current.classList.contains("m")) return;
      var marks = visibleMarks(), index = marks.indexOf(current), next = null;
      if (event.key === "ArrowRight") next = marks[index + 1];
      else if (event.key === "ArrowLeft") next = marks[index - 1];
      else if (event.key === "ArrowDown") next = nearestInRow(marks, current, 1);
      else if (event.key === "ArrowUp") next = nearestInRow(marks, current, -1);
      else if (event.key === "Home") next = marks[0];
      else if (event.key === "End") next = marks[marks.length - 1];
      else return;
      event.preventDefault();
      if (next) { rove(next); next.focus(); }
    });
    heatmap.addEventListener("focusin", function (event) {
      if (event.target.classList && event.target.classList.contains("m")) rove(event.target);
    });
  }

  document.addEventListener("keydown", function (event) {
    if (event.key === "Escape" && panel && !panel.hidden) { event.preventDefault(); closePanel(); }
  });

  // A failure entry draws its timeline when it is opened.
  document.querySelectorAll("details.failure").forEach(function (entry) {
    entry.addEventListener("toggle", function () {
      if (entry.open) fillTimeline(entry.querySelector(".timeline"), entry.dataset.cell);
    });
  });

  window.addEventListener("hashchange", fromHash);
  fromHash(null, "start");
  // Opened at a permalink, the browser scrolls to the cell's square itself, at a time of its own
  // choosing around the load (after this script, after the load event's handlers: it varies): the
  // panel is where the reader wants to be, so it is brought back to the top after the load and once
  // more after the next two frames, whatever ran in between.
  window.addEventListener("load", function () {
    var again = function () { if (panel && !panel.hidden) focusPanel("start"); };
    setTimeout(again, 0);
    requestAnimationFrame(function () { requestAnimationFrame(again); });
  });
})();
