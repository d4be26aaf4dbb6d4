"""A data worker process that imports no torch: the standard library only, so it starts in tens of
milliseconds (a worker that imported torch would spend seconds on it before its first read).

The rank runs this file *by path* (``python -I -S .../_worker.py FD``: running ``-m distlab.data._worker``
would import the ``distlab`` package, and with it torch). It talks over one socket (file descriptor FD,
passed to it), in frames of a 4-byte length and a pickle::

    rank                                      worker (this file)
    ----                                      ------------------
    {"path" | "text", "seq_len"}  --------->  the source: a file read by byte ranges (pread), or bytes
    (ids, latency, cpu)           --------->  sleep latency; read window i = bytes [i T, i T + T + 1);
                                  <---------  ("ok", the windows' bytes, concatenated) | ("error", traceback)
    close the socket              --------->  end of file: the worker exits

Requests are answered in the order they came, so a rank that sends batch k to worker ``k % N`` and
receives in the order it sent gets the stream's batches in order. The rank turns the bytes into tensors
(``TextCorpus.from_bytes``). A worker ignores Ctrl-C (the rank decides) and exits at end of file, which it
reads also when its rank is killed; the rank's lifeline ends it too (`distlab.launch.lifeline`).

`burn` is the "decode" of ``Loader(cpu=...)``: pure Python holding the GIL for ``cpu`` seconds of CPU, as a
tokeniser written in Python would (simulated, as ``latency`` simulates slow storage). Threads share one
GIL, so thread workers take that CPU from the rank's own Python; process workers take it elsewhere.
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import struct
import sys
import time
import traceback

_HEADER = struct.Struct("!I")


def send(sock: socket.socket, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _exactly(sock: socket.socket, n: int) -> bytes | None:
    buf, got = bytearray(n), 0
    view = memoryview(buf)
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None                          # end of file
        got += k
    return bytes(buf)


def receive(sock: socket.socket):
    """The next frame's object; raises EOFError at end of file."""
    head = _exactly(sock, _HEADER.size)
    body = None if head is None else _exactly(sock, _HEADER.unpack(head)[0])
    if body is None:
        raise EOFError("the other end closed the connection")
    return pickle.loads(body)


def burn(seconds: float) -> int:
    """Spend ``seconds`` of this thread's CPU time in pure Python (the GIL held throughout, but for the
    interpreter's switch interval), like a tokeniser written in Python: a checksum of byte arithmetic."""
    end, acc = time.thread_time() + seconds, 0
    while time.thread_time() < end:
        for b in range(256):
            acc = (acc * 31 + b) & 0xFFFF
    return acc


class Windows:
    """Sample i of a byte source: the ``seq_len + 1`` bytes from byte ``i * seq_len`` (`TextCorpus`'s)."""

    def __init__(self, source: dict):
        self.seq_len = int(source["seq_len"])
        self.text, self.fd = source.get("text"), None
        if self.text is None:
            self.fd = os.open(source["path"], os.O_RDONLY)
            self.length = os.fstat(self.fd).st_size
        else:
            self.length = len(self.text)

    def read(self, ids: list[int]) -> bytes:
        t, parts = self.seq_len, []
        for i in ids:
            start = i * t
            if not 0 <= start <= self.length - t - 1:
                raise IndexError(f"sample {i} is outside a corpus of {(self.length - 1) // t} samples")
            part = (self.text[start:start + t + 1] if self.fd is None else os.pread(self.fd, t + 1, start))
            parts.append(part)
        return b"".join(parts)


def serve(sock: socket.socket) -> None:
    """Answer requests until end of file; an error in a read is sent back, and the worker goes on."""
    try:
        source = receive(sock)
    except EOFError:
        return
    try:
        windows, broken = Windows(source), None
    except Exception:                            # noqa: BLE001 - told to the rank at its first read
        windows, broken = None, traceback.format_exc()
    while True:
        try:
            ids, latency, cpu = receive(sock)
        except EOFError:
            return
        try:
            if broken:
                raise RuntimeError(f"the worker could not open its source:\n{broken}")
            if latency:
                time.sleep(latency)
            burn(cpu)
            reply = ("ok", windows.read(ids))
        except Exception:                        # noqa: BLE001 - any error goes back to the rank
            reply = ("error", traceback.format_exc())
        send(sock, reply)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(argv[1]))
    try:
        serve(sock)
    except (BrokenPipeError, ConnectionResetError):
        pass                                     # the rank went away mid-reply
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
