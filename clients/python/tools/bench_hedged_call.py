"""What a hedge timer costs a fast call (issue 33): arequest_with_retries to a
loopback HTTP server answering at once, with the upstream's hedging on (a
delay of 1 s that never fires) and off. No retryd is asked either way (a
fast call never asks); the client's target is a closed port.

Run: ``.venv/bin/python tools/bench_hedged_call.py`` (from clients/python).
Prints µs per call, the best of 10 interleaved rounds of 500 sequential calls.
"""

from __future__ import annotations

import asyncio
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from retryd import AsyncClient, Idempotency
from retryd.hedging import Hedging
from retryd.httpx import arequest_with_retries

ROUNDS = 10
N = 500


class _Ok(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        # One write: headers and body in separate segments would wait on
        # the client's delayed ACK (40 ms a call).
        self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    def log_message(self, *args: object) -> None:
        pass


async def main() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    client = AsyncClient("127.0.0.1:1", timeout=0.2, connect_timeout=0.1, report_interval=3600)
    client.hedging.update([Hedging("hedged", True, 1.0, 1, frozenset({int(Idempotency.SAFE)}))])
    async with httpx.AsyncClient() as http:
        # Rounds interleaved, so that a busy machine's bad moments hit both.
        fastest = {"plain": float("inf"), "hedged": float("inf")}
        for _ in range(ROUNDS):
            for upstream in fastest:
                started = time.perf_counter()
                for _ in range(N):
                    await arequest_with_retries(http, client, "GET", url, upstream=upstream,
                                                idempotency=Idempotency.SAFE)
                fastest[upstream] = min(fastest[upstream], time.perf_counter() - started)
        for upstream, seconds in fastest.items():
            print(f"{upstream:<8} {seconds / N * 1e6:8.1f} µs per call")
    server.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
