// compare.html's script, inlined into it: the filters (only the cells that differ, a case, a world
// size) over the rows of both tables, and a permalink (#cell-...) that the filters never hide.
// Nothing is fetched. Each part does nothing on a page that lacks its elements.
(function () {
  "use strict";
  var bar = document.getElementById("compare-filters");
  var onlyDiffering = document.getElementById("only-differing");
  var caseSelect = document.getElementById("compare-case");
  var wsSelect = document.getElementById("compare-ws");
  var counter = document.getElementById("compare-shown");
  var reset = document.getElementById("compare-reset");
  var rows = document.querySelectorAll("tr[data-case]");

  function wanted(row) {
    if (onlyDiffering && onlyDiffering.checked && row.dataset.differs !== "1") return false;
    if (caseSelect && caseSelect.value && row.dataset.case !== caseSelect.value) return false;
    if (wsSelect && wsSelect.value && row.dataset.ws !== wsSelect.value) return false;
    return true;
  }

  function apply() {
    var shown = 0, total = 0;
    rows.forEach(function (row) {
      row.hidden = !wanted(row);
      if (row.id) {  // the whole table's rows: one per cell
        total += 1;
        if (!row.hidden) shown += 1;
      }
    });
    if (counter) counter.textContent = "showing " + shown + " of " + total + " cells";
  }

  function showAll() {
    if (onlyDiffering) onlyDiffering.checked = false;
    if (caseSelect) caseSelect.value = "";
    if (wsSelect) wsSelect.value = "";
    apply();
  }

  // The row a #cell-... permalink names (the fragment as written, else percent-decoded).
  function targetRow() {
    var raw = location.hash.slice(1), row = raw ? document.getElementById(raw) : null;
    if (!row && raw) {
      try { row = document.getElementById(decodeURIComponent(raw)); } catch (e) { row = null; }
    }
    return row && row.matches("tr[data-case]") ? row : null;
  }

  function fromHash() {
    var row = targetRow();
    if (!row) return;
    if (row.hidden) showAll();
    row.scrollIntoView({ block: "center" });
  }

  if (bar) {
    bar.hidden = false;
    bar.addEventListener("change", apply);
    if (reset) reset.addEventListener("click", showAll);
    apply();
  }
  window.addEventListener("hashchange", fromHash);
  fromHash();
})();
