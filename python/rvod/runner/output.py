"""Forwarding of workers' output to rvodrun's own streams, one whole line at a time.

Every line a worker writes comes out as `[<rank>]<stdout>:line` (or `<stderr>`) on the matching stream
of rvodrun, flushed at once. Lines from different workers never interleave mid-line because all writes,
including rvodrun's own messages, go through one lock. Bytes that are not UTF-8 are replaced, never fatal.
"""

from __future__ import annotations

import threading
from typing import IO, TextIO

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


def forward_lines(pipe: IO[bytes], prefix: str, stream: TextIO, copy: IO[bytes] | None = None) -> None:
    """Reads `pipe` to its end, writing each line to `stream` behind `prefix` and, raw, to `copy`.

    A last line without a newline is still forwarded. Both `pipe` and `copy` are closed at the end.
    """
    try:
        for line in iter(pipe.readline, b""):
            if copy is not None:
                copy.write(line)
                copy.flush()
            body = line[:-1] if line.endswith(b"\n") else line
            write_line(stream, prefix + body.decode("utf-8", "replace"))
    finally:
        pipe.close()
        if copy is not None:
            copy.close()


def start_forwarding(pipe: IO[bytes], prefix: str, stream: TextIO, copy: IO[bytes] | None = None) -> threading.Thread:
    """Runs `forward_lines` on a daemon thread, so a pipe held open by a stray process cannot block exit."""
    thread = threading.Thread(
        target=forward_lines, args=(pipe, prefix, stream, copy), name=f"rvodrun-output {prefix}", daemon=True
    )
    thread.start()
    return thread
