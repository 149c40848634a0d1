"""A loopback HTTP server for shard tests and the data benchmark: serves folders with Range support, and
injects faults on request.

    with ShardServer({"wiki": wiki_dir}) as server:      # 127.0.0.1, a free port, daemon threads
        url = server.url("wiki/manifest.json")
        server.faults["wiki-000002.tar"] = ["503", "drop", "stall", "reset"]  # one per GET, then normal answers
        server.corrupt["wiki-000003.tar"] = 5000          # byte 5000 flipped in every answer
        server.requests                                   # [(path, Range header or None)], GETs in arrival order

Faults: "ok" a normal answer (to fault a later request); "503" an error answer; "drop" the headers and half the body, then the connection closes; "stall" the
headers, then nothing until `stall_seconds` pass or the server stops; "reset" the connection closes before
any answer. `python tests/http_shards.py FOLDER --port-file F` serves FOLDER until it is killed.
"""

from __future__ import annotations

import argparse
import os
import posixpath
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


class ShardServer(ThreadingHTTPServer):
    daemon_threads = True  # a stalled answer never holds up the test process

    def __init__(self, folders: dict[str, str | os.PathLike] | str | os.PathLike, stall_seconds: float = 10.0):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.folders = {k: Path(v) for k, v in folders.items()} if isinstance(folders, dict) else {"": Path(folders)}
        self.stall_seconds = stall_seconds
        self.faults: dict[str, list[str]] = {}  # file name -> faults for its next GETs, in order
        self.corrupt: dict[str, int] = {}  # file name -> byte offset flipped in every answer
        self.requests: list[tuple[str, str | None]] = []
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{path}"

    def file(self, path: str) -> Path | None:
        parts = posixpath.normpath(unquote(urlsplit(path).path)).lstrip("/").split("/")
        if ".." in parts:
            return None
        for prefix, folder in self.folders.items():
            if not prefix:
                return folder.joinpath(*parts)
            if parts[0] == prefix:
                return folder.joinpath(*parts[1:])
        return None

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()  # releases stalled answers
        self.shutdown()
        self.server_close()
        self._thread.join(timeout=5)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as production servers do
    server: ShardServer

    def setup(self) -> None:
        super().setup()
        # as production servers do on keep-alive connections: without it, Nagle's algorithm holds the end of
        # each answer until the client's delayed ACK (tens of ms per request)
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        path = self.server.file(self.path)
        header = self.headers.get("Range")
        if body:
            self.server.requests.append((posixpath.basename(urlsplit(self.path).path), header))
        if path is None or not path.is_file():
            self.send_error(404)
            return
        name = path.name
        size = path.stat().st_size
        start, end = 0, size
        ranged = header is not None and _RANGE.match(header)
        if ranged:
            start = int(ranged.group(1))
            end = min(size, int(ranged.group(2)) + 1) if ranged.group(2) else size
            if start >= size:
                self.send_error(416)
                return
        fault = self.server.faults[name].pop(0) if body and self.server.faults.get(name) else None
        if fault == "503":
            self.send_error(503, "injected")
            return
        if fault == "reset":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.send_response(206 if ranged else 200)
        self.send_header("Content-Type", "application/x-tar")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start))
        if ranged:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if not body:
            return
        if fault in ("drop", "stall"):
            self.wfile.write(self._bytes(path, start, start + (end - start) // 2 if fault == "drop" else start))
            self.wfile.flush()
            if fault == "stall":
                self.server.stopping.wait(self.server.stall_seconds)
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
        elif name in self.server.corrupt:
            self.wfile.write(self._bytes(path, start, end))
        else:
            with open(path, "rb") as f:
                self.connection.sendfile(f, start, end - start)  # zero-copy: the server costs the client little

    def _bytes(self, path: Path, start: int, end: int) -> bytes:
        with open(path, "rb") as f:
            f.seek(start)
            data = bytearray(f.read(end - start))
        flip = self.server.corrupt.get(path.name)
        if flip is not None and start <= flip < end:
            data[flip - start] ^= 0xFF
        return bytes(data)


def main() -> None:
    parser = argparse.ArgumentParser(description="serve a folder over loopback HTTP with Range support")
    parser.add_argument("folder")
    parser.add_argument("--port-file", required=True, help="written with the port once the server listens")
    args = parser.parse_args()
    server = ShardServer(args.folder)
    tmp = f"{args.port_file}.tmp"
    Path(tmp).write_text(str(server.server_address[1]))
    os.replace(tmp, args.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
