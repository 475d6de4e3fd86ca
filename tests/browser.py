"""A small headless Chromium driver for the tests of the HTML reports, with no dependency beyond the
standard library: the Chrome DevTools Protocol over a pipe (``--remote-debugging-pipe``).

Chromium reads NUL-terminated JSON commands on its fd 3 and writes NUL-terminated JSON answers and
events on its fd 4. Each page is a flattened session (its messages carry ``sessionId``) in a browser
context of its own, so pages share no storage. One thread reads fd 4; callers wait, each with a
timeout, on what it has read.

    with Browser.start(find_chromium()) as browser:
        page = browser.open(path.as_uri())
        page.click("#run")
        page.press("Escape")
        assert page.evaluate("document.title") == "matrix"
        page.screenshot(tmp_path / "matrix.png", full_page=True)
        assert not page.console_errors
"""

from __future__ import annotations

import atexit
import base64
import fcntl
import json
import math
import os
import shutil
import signal
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

TIMEOUT = 20.0

# No network: every host name resolves to nothing, and none of Chromium's own background traffic.
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
    "--no-default-browser-check", "--disable-background-networking", "--disable-component-update",
    "--disable-default-apps", "--disable-extensions", "--disable-sync", "--disable-breakpad",
    "--disable-crash-reporter", "--disable-domain-reliability", "--disable-client-side-phishing-detection",
    "--disable-features=Translate,OptimizationHints,MediaRouter,DialMediaRouteProvider,AutofillServerCommunication",
    "--no-pings", "--metrics-recording-only", "--password-store=basic", "--use-mock-keychain",
    "--mute-audio", "--host-resolver-rules=MAP * ~NOTFOUND", "--remote-debugging-pipe",
]


# What Chrome answers to an evaluation that a navigation interrupted.
_NAVIGATING = ("Inspected target navigated or closed", "Execution context was destroyed",
               "Cannot find context with specified id")


class BrowserError(RuntimeError):
    """Chromium could not start, died, refused a command, or a wait ran out."""


class BrowserTimeout(BrowserError):
    """A wait ran out; the message says what was waited for."""


class JavaScriptError(BrowserError):
    """An expression given to ``Page.evaluate`` threw (or its promise rejected)."""


@dataclass(frozen=True)
class ConsoleError:
    """One error a page reported: ``kind`` is console (console.error/assert), exception (uncaught) or log."""

    kind: str
    text: str
    location: str = ""

    def __str__(self) -> str:
        return f"{self.kind}: {self.text}" + (f" ({self.location})" if self.location else "")

    __repr__ = __str__


def find_chromium() -> str | None:
    """``$HARNESS_CHROMIUM`` if set, else the first of chromium, chromium-browser, google-chrome on PATH."""
    named = os.environ.get("HARNESS_CHROMIUM")
    if named:
        return shutil.which(named) or (named if os.access(named, os.X_OK) else None)
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _high_fd(fd: int) -> int:
    """``fd`` moved to 10 or above (close-on-exec), so that placing it at 3 or 4 in the child never clobbers."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return moved


_LIVE: set[Browser] = set()
atexit.register(lambda: [b.close() for b in list(_LIVE)])


class Browser:
    """One Chromium process. Use ``Browser.start`` (a context manager); ``close`` always kills it."""

    def __init__(self, path: str, width: int = 1400, height: int = 900, timeout: float = TIMEOUT,
                 extra_args: tuple[str, ...] = ()):
        self.path, self.width, self.height, self.timeout = path, width, height, timeout
        self._cond = threading.Condition()
        self._write_lock = threading.Lock()
        self._next_id = 0
        self._answers: dict[int, dict] = {}
        self._pending: set[int] = set()
        self._pages: dict[str, Page] = {}
        self._eof = False
        self._closed = False
        self._pid: int | None = None
        self._status: int | None = None
        self._dir = tempfile.mkdtemp(prefix="harness-chromium-")
        self._stderr_path = os.path.join(self._dir, "stderr.log")
        commands_read, self._commands = os.pipe()   # we write commands; Chromium reads them on fd 3
        self._events, events_write = os.pipe()      # Chromium writes on fd 4; we read
        commands_read, events_write = _high_fd(commands_read), _high_fd(events_write)
        argv = [path, *FLAGS, f"--user-data-dir={os.path.join(self._dir, 'profile')}",
                f"--window-size={width},{height}", *extra_args, "about:blank"]
        # posix_spawn rather than subprocess: Chromium needs the pipes at exactly fds 3 and 4, and
        # subprocess's pass_fds keeps a descriptor's number. setsid: Chromium and all it starts form
        # one process group, killed as one.
        stderr = os.open(self._stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            _LIVE.add(self)
            # A home of its own: crashpad's database and any other per-user file land in the temp dir.
            home = os.path.join(self._dir, "home")
            env = dict(os.environ, HOME=home, XDG_CONFIG_HOME=os.path.join(home, ".config"),
                       XDG_CACHE_HOME=os.path.join(home, ".cache"))
            self._pid = os.posix_spawn(path, argv, env, setsid=True, file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0), (os.POSIX_SPAWN_DUP2, stderr, 1),
                (os.POSIX_SPAWN_DUP2, stderr, 2), (os.POSIX_SPAWN_DUP2, commands_read, 3),
                (os.POSIX_SPAWN_DUP2, events_write, 4)])
        except BaseException:
            self.close()
            raise
        finally:
            for fd in (stderr, commands_read, events_write):
                os.close(fd)
        self._reader = threading.Thread(target=self._read, name=f"chromium-{self._pid}", daemon=True)
        self._reader.start()
        try:
            self.version = self.send("Browser.getVersion", what="Chromium to start")["product"]
        except BaseException:
            self.close()
            raise

    @classmethod
    def start(cls, path: str | None = None, width: int = 1400, height: int = 900, timeout: float = TIMEOUT,
              extra_args: tuple[str, ...] = ()) -> Browser:
        """Start Chromium (``path``, else ``find_chromium()``) and wait until it answers."""
        path = path or find_chromium()
        if not path:
            raise BrowserError("no Chromium found: install chromium or set HARNESS_CHROMIUM")
        return cls(shutil.which(path) or path, width, height, timeout, extra_args)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pid(self) -> int | None:
        return self._pid

    # -- the pipe ---------------------------------------------------------------------------------

    def _read(self) -> None:
        parts: list[bytes] = []
        while True:
            try:
                chunk = os.read(self._events, 1 << 20)
            except OSError:
                chunk = b""
            if not chunk:
                break
            start = 0
            while (end := chunk.find(b"\0", start)) >= 0:
                parts.append(chunk[start:end])
                try:
                    self._dispatch(json.loads(b"".join(parts)))
                except (ValueError, KeyError, BrowserError):
                    pass  # one bad message, or a dialog answered as the browser closed: read on
                parts, start = [], end + 1
            parts.append(chunk[start:])
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def _dispatch(self, message: dict) -> None:
        with self._cond:
            if "id" in message:
                if message["id"] in self._pending:
                    self._answers[message["id"]] = message
            else:
                page = self._pages.get(message.get("sessionId", ""))
                if page is not None:
                    page._event(message["method"], message.get("params", {}))
            self._cond.notify_all()

    def _post(self, method: str, params: dict | None = None, session: str | None = None,
              what: str | None = None) -> int:
        with self._cond:
            if self._closed or self._eof:
                raise BrowserError(self._death(f"waiting for {what}" if what else f"sending {method}"))
            self._next_id += 1
            ident = self._next_id
            self._pending.add(ident)
        message = {"id": ident, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        data = json.dumps(message).encode() + b"\0"
        with self._write_lock:
            try:
                while data:
                    data = data[os.write(self._commands, data):]
            except OSError as error:
                raise BrowserError(self._death(f"waiting for {what}" if what else f"sending {method} ({error})")) from None
        return ident

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float | None = None, what: str | None = None, guard: Callable[[], None] | None = None) -> dict:
        """Send one command and wait for its answer (the ``result``); a protocol error raises."""
        what = what or f"the answer to {method}"
        ident = self._post(method, params, session, what)
        try:
            answer = self.wait(lambda: self._answers.pop(ident, None), what, timeout, guard)
        finally:
            with self._cond:
                self._pending.discard(ident)
        if "error" in answer:
            error = answer["error"]
            detail = f" ({error['data']})" if error.get("data") else ""
            raise BrowserError(f"{method} failed: {error.get('message')}{detail}")
        return answer.get("result", {})

    def wait(self, ready: Callable[[], Any], what: str, timeout: float | None = None,
             guard: Callable[[], None] | None = None) -> Any:
        """Wait until ``ready()`` (called under the lock, after each message read) returns something
        truthy, and return it; raise if Chromium dies, ``guard()`` raises, or ``timeout`` seconds pass."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if guard is not None:
                    guard()
                value = ready()
                if value:
                    return value
                if self._eof or self._closed:
                    raise BrowserError(self._death(f"waiting for {what}"))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BrowserTimeout(f"timed out after {timeout:g} s waiting for {what}")
                self._cond.wait(left)

    def _death(self, doing: str) -> str:
        if self._closed:
            return f"the browser was closed ({doing})"
        status = self._reap(wait=1.0)
        code = "still running" if status is None else f"exit status {os.waitstatus_to_exitcode(status)}"
        return f"Chromium closed its pipe ({code}) while {doing}; its stderr ends:\n{self.stderr_tail()}"

    def stderr_tail(self, chars: int = 3000) -> str:
        """The end of Chromium's stderr, less its complaints about the absent D-Bus."""
        try:
            lines = Path(self._stderr_path).read_text(errors="replace").splitlines()
        except OSError:
            return "(no stderr)"
        return "\n".join(line for line in lines if "dbus" not in line.lower())[-chars:] or "(empty)"

    def _strays(self) -> list[int]:
        """Live processes that name this browser's temp dir: Chromium's own, and crashpad's handlers,
        which leave its process group."""
        needle, found = self._dir.encode(), []
        for entry in os.listdir("/proc"):
            try:
                if entry.isdigit() and needle in Path("/proc", entry, "cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                continue
        return found

    def _reap(self, wait: float = 0.0) -> int | None:
        deadline = time.monotonic() + wait
        while self._status is None and self._pid is not None:
            try:
                pid, status = os.waitpid(self._pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = self._pid, 0
            if pid:
                self._status = status
            elif time.monotonic() >= deadline:
                break
            else:
                time.sleep(0.02)
        return self._status

    # -- pages and closing -------------------------------------------------------------------------

    def open(self, url: str, timeout: float | None = None) -> Page:
        """A new page (tab) in a browser context of its own, at ``url``, after its load event."""
        context = self.send("Target.createBrowserContext")["browserContextId"]
        target = self.send("Target.createTarget", {"url": "about:blank", "browserContextId": context})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, target, session, context)
        with self._cond:
            self._pages[session] = page
        try:
            for method, params in [
                ("Page.enable", {}), ("Page.setLifecycleEventsEnabled", {"enabled": True}),
                ("Runtime.enable", {}), ("Log.enable", {}), ("Inspector.enable", {}),
                ("Emulation.setFocusEmulationEnabled", {"enabled": True}),
            ]:
                page.send(method, params)
            page._set_viewport()
            page.goto(url, timeout=timeout)
        except BaseException:
            page.close()
            raise
        return page

    def close(self) -> None:
        """Close every page, then end Chromium (politely for a moment, then SIGKILL to its whole
        process group) and remove its profile. Safe to call twice."""
        if self._closed:
            return
        if self._pid is not None and not self._eof:
            try:
                self._post("Browser.close")
                self._reap(wait=2.0)
            except BrowserError:
                pass
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._pid is not None:
            try:
                os.killpg(self._pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self._reap(wait=10.0)
            for pid in self._strays():
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for fd in (self._commands, self._events):
            try:
                os.close(fd)
            except OSError:
                pass
        if getattr(self, "_reader", None) is not None:
            self._reader.join(timeout=5)
        shutil.rmtree(self._dir, ignore_errors=True)
        _LIVE.discard(self)


_MODIFIERS = {"Alt": 1, "Control": 2, "Meta": 4, "Shift": 8}
# key -> (code, windowsVirtualKeyCode, text)
_KEYS = {
    "Tab": ("Tab", 9, ""), "Enter": ("Enter", 13, "\r"), "Escape": ("Escape", 27, ""),
    "Backspace": ("Backspace", 8, ""), "Delete": ("Delete", 46, ""), " ": ("Space", 32, " "),
    "ArrowLeft": ("ArrowLeft", 37, ""), "ArrowUp": ("ArrowUp", 38, ""), "ArrowRight": ("ArrowRight", 39, ""),
    "ArrowDown": ("ArrowDown", 40, ""), "Home": ("Home", 36, ""), "End": ("End", 35, ""),
    "PageUp": ("PageUp", 33, ""), "PageDown": ("PageDown", 34, ""),
    "Alt": ("AltLeft", 18, ""), "Control": ("ControlLeft", 17, ""), "Meta": ("MetaLeft", 91, ""),
    "Shift": ("ShiftLeft", 16, ""),
}
_PUNCTUATION = {";": ("Semicolon", 186), "=": ("Equal", 187), ",": ("Comma", 188), "-": ("Minus", 189),
                ".": ("Period", 190), "/": ("Slash", 191), "`": ("Backquote", 192), "[": ("BracketLeft", 219),
                "\\": ("Backslash", 220), "]": ("BracketRight", 221), "'": ("Quote", 222)}


def _key(key: str) -> tuple[str, int, str]:
    if key in _KEYS:
        return _KEYS[key]
    if key == "Space":
        return _KEYS[" "]
    if len(key) != 1:
        raise ValueError(f"unknown key {key!r}: use a single character or one of {sorted(_KEYS)}")
    if key.isascii() and key.isalpha():
        return f"Key{key.upper()}", ord(key.upper()), key
    if key.isdigit():
        return f"Digit{key}", ord(key), key
    code, number = _PUNCTUATION.get(key, ("", 0))
    return code, number, key


# Finds the element, scrolls it to the middle of the viewport and says where its centre is, and what
# the topmost element there is when that is neither it nor inside it.
_LOCATE = """(selector) => {
  const el = document.querySelector(selector);
  if (!el) return {problem: "no element matches it"};
  el.scrollIntoView({block: "center", inline: "center", behavior: "instant"});
  const r = el.getBoundingClientRect();
  if (r.width === 0 || r.height === 0) return {problem: "it has no size (hidden?)"};
  const x = r.left + r.width / 2, y = r.top + r.height / 2;
  const hit = document.elementFromPoint(x, y);
  if (hit && (hit === el || el.contains(hit))) return {x, y};
  const name = e => e.tagName.toLowerCase() + (e.id ? "#" + e.id : "")
    + (typeof e.className === "string" && e.className.trim() ? "." + e.className.trim().split(/\\s+/).join(".") : "");
  return {x, y, covered: hit ? name(hit) : "nothing (outside the viewport)"};
}"""


class Page:
    """One tab. ``console_errors`` collects, from the moment the page opened, every console.error
    and failed console.assert, every uncaught exception and unhandled rejection, and every log entry
    of level error (a resource that failed to load, say). ``dialogs`` lists the messages of the
    alert/confirm/prompt dialogs the page opened; each is accepted at once so that none blocks."""

    def __init__(self, browser: Browser, target: str, session: str, context: str):
        self.browser, self.target, self.session, self.context = browser, target, session, context
        self.console_errors: list[ConsoleError] = []
        self.dialogs: list[str] = []
        self._loads: set[str] = set()       # loader ids whose load event fired (main frame)
        self._in_document = 0               # same-document navigations of the main frame
        self._crashed = False
        self._closed = False

    def __enter__(self) -> Page:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _event(self, method: str, params: dict) -> None:
        """Called on the reader thread, under the browser's lock: record, never block."""
        if method == "Page.lifecycleEvent" and params.get("name") == "load" and params.get("frameId") == self.target:
            self._loads.add(params["loaderId"])
        elif method == "Page.navigatedWithinDocument" and params.get("frameId") == self.target:
            self._in_document += 1
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            text = " ".join(_describe(arg) for arg in params.get("args", []))
            frame = (params.get("stackTrace") or {}).get("callFrames") or [{}]
            self.console_errors.append(ConsoleError("console", text, _where(frame[0])))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.console_errors.append(ConsoleError("exception", _exception_text(details), _where(details)))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.console_errors.append(ConsoleError("log", entry.get("text", ""), _where(entry)))
        elif method == "Page.javascriptDialogOpening":
            self.dialogs.append(params.get("message", ""))
            self.browser._post("Page.handleJavaScriptDialog", {"accept": True}, self.session)
        elif method == "Inspector.targetCrashed":
            self._crashed = True
            self.console_errors.append(ConsoleError("crash", "the page's renderer crashed"))

    def send(self, method: str, params: dict | None = None, timeout: float | None = None,
             what: str | None = None) -> dict:
        """A protocol command to this page's session."""
        if self._closed:
            raise BrowserError(f"the page is closed; cannot send {method}")
        what = what or f"the answer to {method}"
        return self.browser.send(method, params, self.session, timeout, what, lambda: self._guard(what))

    def wait(self, ready: Callable[[], Any], what: str, timeout: float | None = None) -> Any:
        """``Browser.wait``, that also raises if this page's renderer crashes."""
        return self.browser.wait(ready, what, timeout, lambda: self._guard(what))

    def _guard(self, what: str) -> None:
        if self._crashed:
            raise BrowserError(f"the page's renderer crashed (waiting for {what}); console errors: {self.console_errors}")

    def goto(self, url: str, timeout: float | None = None) -> None:
        """Navigate to ``url`` and wait for its load event; when only the #fragment changes (a
        same-document navigation) wait instead for the hashchange event to have been dispatched."""
        url = str(url)
        current = self.evaluate("location.href") if self._loads else "about:blank"
        fragment_only = (urllib.parse.urldefrag(url)[0] == urllib.parse.urldefrag(current)[0]
                         and "#" in url and url != current)
        if fragment_only:
            self.evaluate("window.__driverHashchange = new Promise(r => addEventListener('hashchange', r, {once: true})), 0")
        before = self._in_document
        result = self.send("Page.navigate", {"url": url}, timeout, f"the answer to Page.navigate({url})")
        if result.get("errorText"):
            raise BrowserError(f"could not open {url}: {result['errorText']}")
        loader = result.get("loaderId")
        if loader:
            self.wait(lambda: loader in self._loads, f"the load event of {url}", timeout)
        else:
            self.wait(lambda: self._in_document > before, f"the same-document navigation to {url}", timeout)
            if fragment_only:
                self.evaluate("window.__driverHashchange.then(() => { delete window.__driverHashchange; })",
                              timeout=timeout, what=f"the hashchange event of {url}")

    def evaluate(self, expression: str, *args: Any, timeout: float | None = None, what: str | None = None) -> Any:
        """The value of a JavaScript expression (a promise is awaited), as JSON-like Python. With
        ``args`` the expression is a function, called with them: ``evaluate("s => f(s)", "#x")``.
        A throw (or rejection) raises ``JavaScriptError`` with the exception's text."""
        if args:
            expression = f"({expression})(...{json.dumps(list(args))})"
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True},
                           timeout, what or f"the value of {_short(expression)}")
        if "exceptionDetails" in result:
            raise JavaScriptError(f"{_short(expression)} threw: {_exception_text(result['exceptionDetails'])}")
        return _value(result["result"])

    def wait_for(self, expression: str, *args: Any, timeout: float | None = None, what: str | None = None) -> Any:
        """Poll ``expression`` (every 50 ms) until it is truthy and return its value."""
        what = what or f"{_short(expression)} to be true"
        timeout = self.browser.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.evaluate(expression, *args, timeout=max(deadline - time.monotonic(), 0.1), what=what)
            except BrowserTimeout:
                raise BrowserTimeout(f"timed out after {timeout:g} s waiting for {what} (the page did not answer)") from None
            except BrowserError as exc:
                # polled across a navigation (a click that follows a link): the old document is gone
                # before the new one answers, which is "not yet", not an error
                if not any(words in str(exc) for words in _NAVIGATING):
                    raise
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserTimeout(f"timed out after {timeout:g} s waiting for {what} (last value {value!r})")
            time.sleep(0.05)

    def click(self, selector: str, *, force: bool = False, timeout: float | None = None) -> None:
        """A real left click at the centre of the first element matching ``selector``: it is waited
        for (present and sized), scrolled into view, then pressed and released with the mouse. When
        another element covers that point the click raises, unless ``force`` (then the coverer gets it)."""
        spot = self.wait_for(f"(s => {{ const r = ({_LOCATE})(s); return r.problem ? null : r; }})", selector,
                             timeout=timeout, what=f"{selector!r} to be present and visible")
        if spot.get("covered") and not force:
            raise BrowserError(f"click on {selector!r} would land on {spot['covered']}, which covers it")
        x, y = spot["x"], spot["y"]
        for kind, buttons in (("mouseMoved", 0), ("mousePressed", 1), ("mouseReleased", 0)):
            params = {"type": kind, "x": x, "y": y, "buttons": buttons}
            if kind != "mouseMoved":
                params.update(button="left", clickCount=1)
            self.send("Input.dispatchMouseEvent", params)

    def press(self, key: str) -> None:
        """Press and release a key with real key events: a character ("a", "?"), or a name (Tab,
        Enter, Escape, Space, Backspace, Delete, Home, End, PageUp, PageDown, ArrowLeft/Right/Up/Down),
        optionally after modifiers: "Shift+Tab", "Control+a"."""
        *held, key = key.split("+") if len(key) > 1 else [key]
        modifiers = 0
        for name in held:
            if name not in _MODIFIERS:
                raise ValueError(f"unknown modifier {name!r} in {key!r}: use {'/'.join(_MODIFIERS)}")
            modifiers |= _MODIFIERS[name]
            self._key("rawKeyDown", name, modifiers)
        self._key("keyDown", key, modifiers)
        self._key("keyUp", key, modifiers)
        for name in reversed(held):
            modifiers &= ~_MODIFIERS[name]
            self._key("keyUp", name, modifiers)

    def type(self, text: str) -> None:
        """Each character of ``text`` pressed in turn."""
        for char in text:
            self.press(char)

    def _key(self, kind: str, key: str, modifiers: int) -> None:
        code, number, text = _key(key)
        if modifiers & ~_MODIFIERS["Shift"]:
            text = ""  # Control+a selects, it does not type
        params = {"type": kind, "key": key if key != "Space" else " ", "code": code, "modifiers": modifiers,
                  "windowsVirtualKeyCode": number, "nativeVirtualKeyCode": number}
        if kind == "keyDown":
            if text:
                params.update(text=text, unmodifiedText=text)
            else:
                params["type"] = "rawKeyDown"
        if key in _MODIFIERS:
            params["location"] = 1
        self.send("Input.dispatchKeyEvent", params)

    def screenshot(self, path: str | os.PathLike | None = None, full_page: bool = False,
                   timeout: float | None = None) -> bytes:
        """A PNG of the viewport (or of the whole page), written to ``path`` if given, and returned."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            laid_out = self.evaluate(_LAID_OUT)
            metrics = self.send("Page.getLayoutMetrics")
            size = metrics.get("cssContentSize") or metrics["contentSize"]
            params.update(captureBeyondViewport=True, clip={
                "x": 0, "y": 0, "width": math.ceil(size["width"]), "height": math.ceil(size["height"]), "scale": 1})
        try:
            data = base64.b64decode(self.send("Page.captureScreenshot", params, timeout, "a screenshot")["data"])
        finally:
            if full_page:
                self._lay_out_again(laid_out, timeout)
        if path is not None:
            Path(path).write_bytes(data)
        return data

    def _set_viewport(self, height: int | None = None) -> None:
        self.send("Emulation.setDeviceMetricsOverride", {
            "width": self.browser.width, "height": self.browser.height if height is None else height,
            "deviceScaleFactor": 1, "mobile": False})

    def _lay_out_again(self, laid_out: list, timeout: float | None) -> None:
        """Give the page back the layout it had before a full-page capture. captureBeyondViewport
        leaves it laid out without its scrollbar; clearing the override and setting the viewport anew
        brings the scrollbar back, but not always: at times the renderer takes the same size as no
        change and keeps the capture's layout (CI read the width without the scrollbar). So the page
        is resized through another height, which it cannot take as no change, until it reads as
        before (each try is given a second: the renderer lays out after the command returns)."""
        expected = json.dumps(json.dumps(laid_out, separators=(",", ":")))
        timeout = self.browser.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            self.send("Emulation.clearDeviceMetricsOverride")
            self._set_viewport(height=self.browser.height + 1)
            self._set_viewport()
            try:
                self.wait_for(f"JSON.stringify({_LAID_OUT}) === {expected}", timeout=min(1.0, timeout))
                return
            except BrowserTimeout:
                if time.monotonic() > deadline:
                    raise BrowserTimeout(f"timed out after {timeout:g} s waiting for the page to be laid out in "
                                         f"its viewport again after a full-page capture (before: {laid_out}, "
                                         f"now: {self.evaluate(_LAID_OUT)})") from None

    def close(self) -> None:
        """Close the tab and dispose of its browser context. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        browser = self.browser
        with browser._cond:
            browser._pages.pop(self.session, None)
        if not browser._closed and not browser._eof:
            for method, params in (("Target.closeTarget", {"targetId": self.target}),
                                   ("Target.disposeBrowserContext", {"browserContextId": self.context})):
                try:
                    browser.send(method, params)
                except BrowserError:
                    pass


# what a page's layout in its viewport reads as: the window's size, and the root's without its scrollbar
_LAID_OUT = "[innerWidth, innerHeight, document.documentElement.clientWidth, document.documentElement.clientHeight]"


def _short(expression: str, limit: int = 80) -> str:
    flat = " ".join(expression.split())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."


def _where(where: dict) -> str:
    url = where.get("url", "")
    if not url:
        return ""
    line = where.get("lineNumber")
    return f"{url}:{line + 1}" if isinstance(line, int) else url


def _exception_text(details: dict) -> str:
    exception = details.get("exception") or {}
    description = exception.get("description") or _describe(exception) if exception else ""
    text = details.get("text", "")
    if description:
        first = description.splitlines()[0]
        return f"{text} {first}".strip() if text in ("Uncaught", "Uncaught (in promise)") else first
    return text


def _describe(remote: dict) -> str:
    """A console argument as DevTools would show it, briefly: strings bare, objects by their preview."""
    if "value" in remote:
        value = remote["value"]
        return value if isinstance(value, str) else json.dumps(value)
    preview = remote.get("preview")
    if preview and remote.get("subtype") not in ("error", "node"):
        items = [p.get("value", p.get("type", "")) if preview.get("subtype") == "array"
                 else f"{p['name']}: {p.get('value', p.get('type', ''))}" for p in preview.get("properties", [])]
        items += ["..."] if preview.get("overflow") else []
        opening, closing = "[]" if preview.get("subtype") == "array" else "{}"
        return opening + ", ".join(items) + closing
    return remote.get("unserializableValue") or remote.get("description") or remote.get("type", "")


def _value(remote: dict) -> Any:
    if "unserializableValue" in remote:
        text = remote["unserializableValue"]
        if text.endswith("n"):
            return int(text[:-1])
        return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf, "-0": -0.0}[text]
    return remote.get("value")
