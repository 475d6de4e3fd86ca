"""The headless Chromium driver (tests/browser.py) on tiny pages: values, errors, clicks, keys,
fragments, screenshots, and that no Chromium outlives its Browser."""

from __future__ import annotations

import math
import os
import signal
import struct
import time
from pathlib import Path

import pytest
from browser import Browser, BrowserError, BrowserTimeout, JavaScriptError, find_chromium


@pytest.fixture
def open_page(browser, tmp_path):
    """Write a tiny HTML page and open it; the pages are closed after the test."""
    pages = []

    def open_(body: str, name: str = "page.html"):
        path = tmp_path / name
        path.write_text(f"<!doctype html><html><head><meta charset=utf-8><title>t</title></head><body>{body}</body></html>",
                        encoding="utf-8")
        pages.append(browser.open(path.as_uri()))
        return pages[-1]

    yield open_
    for page in pages:
        page.close()


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", data[:16]
    return struct.unpack(">II", data[16:24])


def test_evaluate_returns_values(open_page):
    page = open_page("<p id=p>hello</p>")
    assert page.evaluate("1 + 2") == 3
    assert page.evaluate("document.getElementById('p').textContent") == "hello"
    assert page.evaluate("({a: [1, 'x', null, true], b: {c: 1.5}})") == {"a": [1, "x", None, True], "b": {"c": 1.5}}
    assert page.evaluate("undefined") is None
    assert math.isnan(page.evaluate("NaN")) and page.evaluate("-Infinity") == -math.inf
    assert page.evaluate("new Promise(r => setTimeout(() => r('later'), 10))") == "later"
    assert page.evaluate("(s, n) => document.querySelector(s).textContent.repeat(n)", "#p", 2) == "hellohello"
    assert page.evaluate("[innerWidth, innerHeight, devicePixelRatio]") == [1400, 900, 1]


def test_a_throw_in_evaluate_raises_with_its_text_and_is_no_console_error(open_page):
    page = open_page("")
    with pytest.raises(JavaScriptError, match="Error: boom"):
        page.evaluate("(() => { throw new Error('boom'); })()")
    with pytest.raises(JavaScriptError, match="TypeError: rejected"):
        page.evaluate("Promise.reject(new TypeError('rejected'))")
    assert page.console_errors == []


def test_a_clean_page_has_no_console_errors(open_page):
    page = open_page("<button>ok</button><script>console.log('fine'); console.warn('only a warning');</script>")
    assert page.console_errors == []


def test_errors_at_load_land_in_console_errors(open_page):
    page = open_page("""<img src="missing.png">
        <script>console.error("bad", 42);</script>
        <script>Promise.reject(new Error("nobody caught me"));</script>
        <script>throw new Error("thrown at load");</script>""")
    page.wait_for("true")  # the rejection is reported after a microtask checkpoint
    texts = {(e.kind, e.text) for e in page.console_errors}
    assert ("console", "bad 42") in texts
    assert ("exception", "Uncaught Error: thrown at load") in texts
    assert ("exception", "Uncaught (in promise) Error: nobody caught me") in texts
    assert any(e.kind == "log" and "ERR_FILE_NOT_FOUND" in e.text for e in page.console_errors), page.console_errors
    assert all(e.location.endswith("missing.png" if e.kind == "log" else "page.html:3") or e.location.endswith("page.html:4")
               or e.location.endswith("page.html:2") for e in page.console_errors), page.console_errors
    assert len(page.console_errors) == 4, page.console_errors


def test_errors_after_load_are_collected_too(open_page):
    page = open_page("<button id=b onclick=\"console.assert(1 === 2, 'one is not two'); undefinedFunction()\">b</button>")
    page.click("#b")
    page.wait_for("true")
    assert [e.kind for e in page.console_errors] == ["console", "exception"], page.console_errors
    assert "one is not two" in page.console_errors[0].text
    assert "undefinedFunction is not defined" in page.console_errors[1].text


def test_a_click_is_a_real_mouse_click_after_scrolling(open_page):
    page = open_page("""<div style="height: 3000px"></div>
        <button id=b>b</button>
        <script>
          window.seen = [];
          for (const kind of ["mousedown", "mouseup", "click"])
            b.addEventListener(kind, e => seen.push([kind, e.isTrusted, e.button]));
        </script>""")
    page.click("#b")
    assert page.evaluate("seen") == [["mousedown", True, 0], ["mouseup", True, 0], ["click", True, 0]]
    assert page.evaluate("scrollY") > 2000


def test_a_covered_element_is_not_clicked_through(open_page):
    page = open_page("""<button id=under onclick="window.hit = 'under'">under</button>
        <div id=cover class="modal open" onclick="window.hit = 'cover'"
             style="position: fixed; inset: 0; background: rgba(0,0,0,.3)"></div>""")
    with pytest.raises(BrowserError, match=r"would land on div#cover.modal.open"):
        page.click("#under")
    assert page.evaluate("window.hit") is None
    page.click("#under", force=True)
    assert page.evaluate("window.hit") == "cover"


def test_click_waits_for_its_element_and_says_what_it_waited_for(open_page):
    page = open_page("<script>setTimeout(() => document.body.innerHTML = '<button id=late>x</button>', 100)</script>")
    page.click("#late")  # appears 100 ms after load
    with pytest.raises(BrowserTimeout, match=r"0.3 s waiting for '#nowhere' to be present and visible"):
        page.click("#nowhere", timeout=0.3)


def test_keys_move_focus_activate_and_reach_listeners(open_page):
    page = open_page("""<button id=one onclick="window.activated = this.id">one</button>
        <button id=two onclick="window.activated = this.id">two</button>
        <input id=text>
        <script>
          window.keys = [];
          addEventListener("keydown", e => keys.push(e.key));
        </script>""")
    page.press("Tab")
    assert page.evaluate("document.activeElement.id") == "one"
    page.press("Tab")
    assert page.evaluate("document.activeElement.id") == "two"
    page.press("Shift+Tab")
    assert page.evaluate("document.activeElement.id") == "one"
    page.press("Enter")
    assert page.evaluate("window.activated") == "one"
    page.press("Escape")
    for key in ("ArrowLeft", "ArrowRight", "ArrowUp", "ArrowDown"):
        page.press(key)
    assert page.evaluate("keys.filter(k => !['Tab', 'Shift', 'Enter'].includes(k))") == [
        "Escape", "ArrowLeft", "ArrowRight", "ArrowUp", "ArrowDown"]
    page.click("#text")
    page.type("aZ1 ?")
    page.press("Backspace")
    assert page.evaluate("text.value") == "aZ1 "


def test_goto_another_fragment_is_a_hashchange_in_the_same_document(open_page, tmp_path):
    page = open_page("""<script>
          window.document_id = Math.random();
          window.hashes = [];
          addEventListener("hashchange", () => hashes.push(location.hash));
        </script>""")
    url = (tmp_path / "page.html").as_uri()
    document = page.evaluate("document_id")
    page.goto(url + "#first")
    assert page.evaluate("hashes") == ["#first"]
    page.goto(url + "#second")
    assert page.evaluate("[hashes, document_id]") == [["#first", "#second"], document]
    (tmp_path / "other.html").write_text("<title>other</title>")
    page.goto((tmp_path / "other.html").as_uri())
    assert page.evaluate("[document.title, window.document_id]") == ["other", None]


def test_screenshots_are_pngs_of_the_viewport_or_the_whole_page(open_page, tmp_path):
    page = open_page('<div style="height: 2500px; background: linear-gradient(red, blue)">tall</div>')
    data = page.screenshot(tmp_path / "viewport.png")
    assert (tmp_path / "viewport.png").read_bytes() == data
    assert png_size(data) == (1400, 900) and len(data) > 1000
    size = "[document.documentElement.scrollWidth, document.documentElement.scrollHeight]"
    content = page.evaluate(size)
    assert content[0] < 1400 and content[1] > 2500  # the viewport's width less the scrollbar
    assert list(png_size(page.screenshot(full_page=True))) == content
    assert page.evaluate(size) == content  # the full-page capture left the layout as it was
    assert png_size(page.screenshot()) == (1400, 900)


def test_a_dialog_does_not_block_the_page(open_page):
    page = open_page("<button id=b onclick=\"alert('hello'); window.after = true\">b</button>")
    page.click("#b")
    page.wait_for("window.after")
    assert page.dialogs == ["hello"]


def test_waits_time_out_saying_what_they_waited_for(open_page):
    page = open_page("")
    # each wait's deadline and its message come from the timeout it was given: the message names 0.2 s,
    # not the browser's default (20 s), and the wait ended before that default could have (a bound on
    # the alternative, not on this machine's speed)
    started = time.monotonic()
    with pytest.raises(BrowserTimeout, match=r"timed out after 0.2 s waiting for window.never to be true"):
        page.wait_for("window.never", timeout=0.2)
    with pytest.raises(BrowserTimeout, match=r"0.2 s waiting for the value of new Promise"):
        page.evaluate("new Promise(() => {})", timeout=0.2)
    assert time.monotonic() - started < page.browser.timeout
    assert page.evaluate("1") == 1  # the page is still usable


def test_a_crashed_page_raises_at_once_and_the_browser_goes_on(open_page):
    page = open_page("")
    with pytest.raises(BrowserError, match="renderer crashed"):
        page.send("Page.crash", timeout=5)  # its answer never comes
    with pytest.raises(BrowserError, match="renderer crashed"):
        page.evaluate("1")
    assert [e.kind for e in page.console_errors] == ["crash"]
    assert open_page("<p>again</p>", "again.html").evaluate("document.body.textContent") == "again"


def test_find_chromium_honours_harness_chromium(monkeypatch):
    monkeypatch.setenv("HARNESS_CHROMIUM", "/nonexistent/chromium")
    assert find_chromium() is None
    monkeypatch.setenv("HARNESS_CHROMIUM", "sh")
    assert find_chromium().endswith("/sh")


def test_a_browser_that_cannot_start_says_so():
    with pytest.raises(BrowserError, match=r"Chromium closed its pipe \(exit status 1\) while waiting for Chromium to start"):
        Browser.start("/bin/false")


def processes_in(directory: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and directory.encode() in Path("/proc", entry, "cmdline").read_bytes():
                found.append(int(entry))
        except OSError:
            continue
    return found


def test_no_chromium_outlives_its_browser_even_one_that_died(browser, tmp_path):
    (tmp_path / "page.html").write_text("<title>x</title>")
    with Browser.start(browser.path) as own:
        directory = own._dir
        page = own.open((tmp_path / "page.html").as_uri())
        assert processes_in(directory)
        os.killpg(own.pid, signal.SIGKILL)
        with pytest.raises(BrowserError, match=r"Chromium closed its pipe \(exit status -9\)"):
            page.evaluate("1")
    assert processes_in(directory) == [] and not os.path.exists(directory)
    with Browser.start(browser.path) as own:
        directory = own._dir
        own.open((tmp_path / "page.html").as_uri())
    assert processes_in(directory) == [] and not os.path.exists(directory)
