"""Reading JSON that may be anything from a path: only a regular file, at most a given size, strict
JSON (UTF-8, no NaN, no duplicate key, no number too large); each problem one line (``Unusable``)."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from harness.text import printable_line

# The largest file read; a real matrix is a few hundred KiB.
MAX_FILE_BYTES = 256 * 1024 * 1024
# JSON nested deeper than this is refused (a matrix nests about six levels).
MAX_NESTING = 100
# Integers with more digits than this are refused (Python's own limit for str -> int).
MAX_INT_DIGITS = 4300
# How much of an offending value an error message shows.
SHOWN_CHARS = 60
_CHUNK_BYTES = 1 << 20


class Unusable(Exception):
    """A file that cannot be read as strict JSON; the message is one line, without the file's name."""


def quoted(text: str) -> str:
    """A string as Python writes it (quoted, every unprintable character escaped), cut when long."""
    shown = repr(text[:SHOWN_CHARS])
    return shown + (f" ({len(text)} characters)" if len(text) > SHOWN_CHARS else "")


def _refuse_constant(name: str) -> Any:
    raise Unusable(f"not JSON ({name} is not a JSON number)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        shown = text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "…"
        raise Unusable(f"the number {shown} is too large (not a finite float)")
    return value


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise Unusable(f"an integer of {digits} digits is too large (more than {MAX_INT_DIGITS})")
    return int(text)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise Unusable(f"duplicate key {quoted(key)} in a JSON object")
        result[key] = value
    return result


def _format_size(size: int) -> str:
    mib = 1024 * 1024
    return f"{size // mib} MiB" if size >= mib and size % mib == 0 else f"{size} bytes"


_FILE_KINDS = (
    (stat.S_ISDIR, "is a directory, not a matrix file"),
    (stat.S_ISFIFO, "is a FIFO (named pipe), not a regular file"),
    (stat.S_ISCHR, "is a character device, not a regular file"),
    (stat.S_ISBLK, "is a block device, not a regular file"),
    (stat.S_ISSOCK, "is a socket, not a regular file"),
)


def _refuse_unless_regular(mode: int) -> None:
    if stat.S_ISREG(mode):
        return
    for is_kind, reason in _FILE_KINDS:
        if is_kind(mode):
            raise Unusable(reason)
    raise Unusable("is not a regular file")


def _refuse_if_too_large(size: int, limit: int) -> None:
    if size > limit:
        raise Unusable(f"is {size} bytes, more than the {_format_size(limit)} a matrix file may have")


def read_regular_file(path: Path) -> bytes:
    """The bytes of a regular file of at most MAX_FILE_BYTES; never blocks on a FIFO or a device."""
    limit = MAX_FILE_BYTES
    try:
        _refuse_unless_regular(os.stat(path).st_mode)
        # O_NONBLOCK: should the path become a FIFO after the stat, opening it does not wait for a writer.
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise Unusable("no such file") from None
    except NotADirectoryError:
        raise Unusable("no such file (a folder on its path is a file)") from None
    except OSError as exc:
        raise Unusable(f"cannot read ({exc.strerror or exc})") from None
    except ValueError:  # e.g. a NUL in the path
        raise Unusable("cannot read (not a valid path)") from None
    try:
        status = os.fstat(fd)
        _refuse_unless_regular(status.st_mode)
        _refuse_if_too_large(status.st_size, limit)
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(_CHUNK_BYTES, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:
            raise Unusable(f"is more than the {_format_size(limit)} a matrix file may have")
        return b"".join(chunks)
    except OSError as exc:
        raise Unusable(f"cannot read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)


def parse_strict_json(raw: bytes) -> Any:
    """Strict JSON: UTF-8 text (a leading BOM allowed), no NaN or Infinity, no number too large
    for its type, no duplicate key in an object, no nesting that exhausts the stack."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise Unusable(f"not JSON: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})") from None
    if not text.strip():
        raise Unusable("not JSON (the file is empty)")
    try:
        return json.loads(
            text,
            parse_constant=_refuse_constant,
            parse_float=_finite_float,
            parse_int=_bounded_int,
            object_pairs_hook=_unique_keys,
        )
    except json.JSONDecodeError as exc:
        raise Unusable(f"not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise Unusable(f"JSON nested too deeply (more than {MAX_NESTING} levels)") from None
    except ValueError as exc:  # a number the parser itself could not convert
        raise Unusable(f"not JSON ({printable_line(exc)[:200]})") from None
