"""matrix.html in a real browser (headless Chromium, tests/browser.py): the reports of a real run
with a planted fault, loaded as a person would open them, and asserted on after the page's script
has run. The run's reports and two screenshots stay in reports/browser-tests/planted/ for a person
to open (HARNESS_PAGES_DIR moves them)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import ROOT, start_pytest

from harness.render.page import cell_anchor

PAGES_DIR = Path(os.environ.get("HARNESS_PAGES_DIR", ROOT / "reports" / "browser-tests"))
# A small real matrix: the fp32 DDP cells of two case files at world sizes 1 and 2, with rank 1's
# gradients scaled by 1+1e-3 after every backward: fail at world size 2, pass at 1, canaries as ever.
PLANTED_RUN = ["cases/test_accumulate.py", "cases/test_no_sync.py", "-k", "fp32 and not compile and not wrapper",
               "--world-sizes", "1,2", "--harness-fault", "rank_grad_perturbed"]


@pytest.fixture(scope="module")
def planted():
    directory = PAGES_DIR / "planted"
    shutil.rmtree(directory, ignore_errors=True)
    process, _token = start_pytest(PLANTED_RUN, directory)
    stdout, stderr = process.communicate(timeout=900)
    assert process.returncode == 1, stdout[-3000:] + stderr[-3000:]  # the planted fault fails cells
    data = json.loads((directory / "matrix.json").read_text(encoding="utf-8"))
    statuses = {c["status"] for c in data["cells"]}
    assert {"pass", "fail"} <= statuses, statuses
    return directory, data


@pytest.fixture
def page(browser, planted):
    directory, _data = planted
    opened = browser.open((directory / "matrix.html").as_uri())
    yield opened
    errors = list(opened.console_errors)
    opened.close()
    assert not errors, "console errors: " + "; ".join(map(str, errors))


def anchor(cell: dict) -> str:
    return cell_anchor(cell["case"], cell["variant"], cell["world_size"])


def test_the_verdict_and_one_heatmap_square_per_cell(page, planted):
    _directory, data = planted
    cells = data["cells"]
    assert page.evaluate("document.querySelector('#verdict').className") == "verdict bad"
    fails = sum(c["status"] == "fail" for c in cells)
    assert f"{fails} fail" in page.evaluate("document.querySelector('#verdict').textContent")
    squares = page.evaluate("""Array.from(document.querySelectorAll('#heatmap a.m')).map(m => ({
        id: m.id, status: m.dataset.status, shown: m.getBoundingClientRect().width > 0,
        colour: getComputedStyle(m).backgroundColor}))""")
    assert sorted(s["id"] for s in squares) == sorted(anchor(c) for c in cells)
    assert {s["id"]: s["status"] for s in squares} == {anchor(c): c["status"] for c in cells}
    assert all(s["shown"] for s in squares)
    colours = {s["status"]: s["colour"] for s in squares}
    assert len(set(colours.values())) == len(colours)  # each status its own colour
    # the whole heatmap of this run is on the first screen once the failures are scrolled past
    assert page.evaluate("document.querySelector('#heatmap').getBoundingClientRect().height") < 900


def test_a_failure_entry_opens_its_timeline_drawn_from_the_cells_checks(page, planted):
    _directory, data = planted
    first = page.evaluate("document.querySelector('#failures details.failure').dataset.cell")
    cell = next(c for c in data["cells"] if anchor(c) == first)
    assert cell["status"] == "fail"
    assert page.evaluate("document.querySelector('#failures details.failure .timeline svg')") is None
    page.click("#failures details.failure > summary")
    page.wait_for("document.querySelector('#failures details.failure').open")
    drawn = page.wait_for("""(() => { const svg = document.querySelector('#failures details.failure .timeline svg');
        if (!svg) return null;
        return {checks: Array.from(svg.querySelectorAll('rect.check')).map(r => [+r.dataset.rank, +r.dataset.step,
                    r.dataset.check, r.dataset.kind || null, getComputedStyle(r).fill]),
                syncs: svg.querySelectorAll('circle.sync').length,
                steps: svg.querySelectorAll('line.optimizer-step').length,
                width: svg.getBoundingClientRect().width}; })()""", what="the timeline's SVG")
    marks = cell["timeline"]["marks"]
    assert sorted(c[:4] for c in drawn["checks"]) == sorted([m["rank"], m["step"], m["check"], m["kind"]] for m in marks)
    steps = cell["timeline"]["steps"]
    assert drawn["syncs"] == sum(s["sync"] is True for s in steps)
    assert drawn["steps"] == sum(s["optimizer_step"] is True for s in steps)
    assert drawn["width"] > 100
    # rank 1 (the perturbed one) is coloured by a diagnosis at its gradient checks, rank 0 agrees
    agreed = {fill for rank, _step, _check, kind, fill in drawn["checks"] if kind is None}
    rank1_grads = [(kind, fill) for rank, _step, check, kind, fill in drawn["checks"] if rank == 1 and check == "grad"]
    assert rank1_grads and all(kind and fill not in agreed for kind, fill in rank1_grads)
    assert all(kind is None for rank, _step, check, kind, _fill in drawn["checks"] if rank == 0 and check == "grad")


def test_filters_hide_what_they_should_and_show_all_brings_it_back(page, planted):
    _directory, data = planted
    cells = data["cells"]

    def visible() -> list[str]:
        return page.evaluate("Array.from(document.querySelectorAll('#heatmap a.m'))"
                             ".filter(m => !m.hidden && getComputedStyle(m).visibility !== 'hidden'"
                             " && m.closest('.card').offsetParent !== null).map(m => m.id)")

    def entries() -> list[str]:
        return page.evaluate("Array.from(document.querySelectorAll('#failures details.failure'))"
                             ".filter(e => e.offsetParent !== null).map(e => e.dataset.cell)")

    page.click('input[name="status"][value="pass"]')
    assert sorted(visible()) == sorted(anchor(c) for c in cells if c["status"] != "pass")
    assert f"showing {sum(c['status'] != 'pass' for c in cells)} of {len(cells)} cells" == \
        page.evaluate("document.getElementById('shown').textContent")
    page.evaluate("(() => { const s = document.getElementById('filter-ws'); s.value = '1';"
                  " s.dispatchEvent(new Event('change', {bubbles: true})); })()")
    assert sorted(visible()) == sorted(anchor(c) for c in cells if c["status"] != "pass" and c["world_size"] == 1)
    assert entries() == [anchor(c) for c in cells if c["status"] == "fail" and c["world_size"] == 1]
    page.click("#filter-reset")
    assert sorted(visible()) == sorted(anchor(c) for c in cells)
    case = "no_sync"
    page.evaluate(f"(() => {{ const s = document.getElementById('filter-case'); s.value = {json.dumps(case)};"
                  " s.dispatchEvent(new Event('change', {bubbles: true})); })()")
    assert sorted(visible()) == sorted(anchor(c) for c in cells if c["case"] == case)
    assert sorted(entries()) == sorted(anchor(c) for c in cells if c["case"] == case and c["status"] == "fail")
    # a count in the verdict shows that status alone
    page.click('#verdict button[data-only-status="fail"]')
    assert sorted(visible()) == sorted(anchor(c) for c in cells if c["status"] == "fail" and c["case"] == case)


def assert_the_panel_is_in_view_from_its_top(page) -> None:
    """After the load and the browser's own scroll to the fragment's square (two frames after the
    load event): the panel's top at the top of the window, the panel whole below it unless it is
    taller than the window (1400x900)."""
    page.wait_for("document.readyState === 'complete'")
    page.wait_for("new Promise(r => requestAnimationFrame(() => requestAnimationFrame(() => "
                  "requestAnimationFrame(() => r(true)))))")
    box = page.evaluate("(() => { const r = document.getElementById('panel').getBoundingClientRect(); "
                        "return {top: r.top, bottom: r.bottom, height: r.height, window: innerHeight}; })()")
    assert abs(box["top"]) <= 2, box  # the panel's heading at the top, nothing blank above it
    assert box["bottom"] <= box["window"] + 1 or box["height"] > box["window"], box  # not cut off


def test_a_permalink_opens_its_panel_at_the_top_of_the_window_every_time(browser, planted):
    directory, data = planted
    failing = [c for c in data["cells"] if c["status"] == "fail"]
    # the first square, one in the middle and the last: a square far down the page and one near its top
    for cell in (failing[0], failing[len(failing) // 2], failing[-1]):
        page = browser.open((directory / "matrix.html").as_uri() + "#" + anchor(cell))
        try:
            page.wait_for("!document.getElementById('panel').hidden")
            assert_the_panel_is_in_view_from_its_top(page)
            assert not page.console_errors, page.console_errors
        finally:
            page.close()


def test_a_permalink_opens_its_cell_and_the_keyboard_moves_between_cells(browser, planted):
    directory, data = planted
    failing = next(c for c in data["cells"] if c["status"] == "fail")
    url = (directory / "matrix.html").as_uri() + "#" + anchor(failing)
    page = browser.open(url)
    try:
        panel = page.wait_for("!document.getElementById('panel').hidden && document.getElementById('panel').textContent")
        assert f"{failing['case']} · {failing['variant']} · ws={failing['world_size']}" in panel
        assert page.evaluate("document.querySelector('#panel .timeline svg') !== null")
        assert page.evaluate("document.activeElement.id") == "panel"
        assert_the_panel_is_in_view_from_its_top(page)
        page.press("Escape")
        assert page.evaluate("document.getElementById('panel').hidden")
        assert page.evaluate("document.activeElement.id") == anchor(failing)  # focus back on its square
        order = page.evaluate("Array.from(document.querySelectorAll('#heatmap a.m')).map(m => m.id)")
        at = order.index(anchor(failing))
        page.press("ArrowRight")
        assert page.evaluate("document.activeElement.id") == order[at + 1]
        page.press("ArrowLeft")
        page.press("Enter")
        page.wait_for("!document.getElementById('panel').hidden")
        assert page.evaluate("location.hash.slice(1)") == anchor(failing)
        # only one square is in the tab order, so Tab leaves the heatmap at once
        assert page.evaluate("document.querySelectorAll('#heatmap a.m[tabindex=\"0\"]').length") == 1
        assert not page.console_errors, page.console_errors
    finally:
        page.close()


def test_a_screenshot_of_the_planted_run_lies_next_to_its_reports(page, planted):
    directory, _data = planted
    page.screenshot(directory / "matrix.png")
    page.click("#failures details.failure > summary")
    page.wait_for("document.querySelector('#failures details.failure .timeline svg') !== null")
    page.evaluate("document.querySelector('#failures details.failure').scrollIntoView()")
    page.screenshot(directory / "matrix-timeline.png")
    for name in ("matrix.png", "matrix-timeline.png"):
        png = (directory / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
