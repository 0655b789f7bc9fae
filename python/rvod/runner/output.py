"""Forwarding of workers' output to rvodrun's own streams, one whole line at a time.

Every line a worker writes comes out as `[<rank>]<stdout>:line` (or `<stderr>`) on the matching stream
of rvodrun, flushed at once (with --prefix-output-with-timestamp, behind the local time as horovodrun
writes it: `Mon Nov 23 15:04:05 2026[0]<stdout>:line`). Lines from different workers never interleave
mid-line because all writes, including rvodrun's own messages, go through one lock. Bytes that are not
UTF-8 are replaced, never fatal. A remote rank's bootstrap reports on its stderr with status lines
(`rvod.runner.remote.STATUS_MARKER`); those are handed to a callback instead of being printed.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import IO, TextIO

StatusCallback = Callable[[dict], None]

_write_lock = threading.Lock()


def write_line(stream: TextIO, text: str) -> None:
    """Writes `text` and a newline to `stream` as one unit; a reader that went away is ignored."""
    data = (text + "\n").encode("utf-8", "replace")
    with _write_lock:
        try:
            stream.flush()
            stream.buffer.write(data)
            stream.buffer.flush()
        except BrokenPipeError:
            pass


def _split_status(line: bytes, marker: bytes, on_status: StatusCallback) -> bytes:
    """`line` without a status report in it (passed to `on_status`); what came before the marker stays."""
    before, found, report = line.partition(marker)
    if not found:
        return line
    try:
        on_status(json.loads(report.decode("utf-8", "replace")))
    except ValueError:
        return line
    return before + b"\n" if before else b""


def forward_lines(pipe: IO[bytes], prefix: str, stream: TextIO, copy: IO[bytes] | None = None, *,
                  timestamp: bool = False, status_marker: str | None = None,
                  on_status: StatusCallback | None = None) -> None:
    """Reads `pipe` to its end, writing each line to `stream` behind `prefix` and, raw, to `copy`.

    A last line without a newline is still forwarded. Both `pipe` and `copy` are closed at the end.
    """
    marker = status_marker.encode() if status_marker is not None else None
    try:
        for line in iter(pipe.readline, b""):
            if marker is not None and on_status is not None:
                line = _split_status(line, marker, on_status)
                if not line:
                    continue
            if copy is not None:
                copy.write(line)
                copy.flush()
            body = line[:-1] if line.endswith(b"\n") else line
            stamp = time.asctime() if timestamp else ""
            write_line(stream, stamp + prefix + body.decode("utf-8", "replace"))
    finally:
        pipe.close()
        if copy is not None:
            copy.close()


def start_forwarding(pipe: IO[bytes], prefix: str, stream: TextIO, copy: IO[bytes] | None = None,
                     **options: object) -> threading.Thread:
    """Runs `forward_lines` on a daemon thread, so a pipe held open by a stray process cannot block exit."""
    thread = threading.Thread(
        target=forward_lines, args=(pipe, prefix, stream, copy), kwargs=options, name=f"rvodrun-output {prefix}",
        daemon=True,
    )
    thread.start()
    return thread
