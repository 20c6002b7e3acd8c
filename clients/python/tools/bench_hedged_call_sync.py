"""What hedging the blocking httpx adapter costs, and the alternative it was chosen over (issue 33).

Against a loopback HTTP/1.1 server that answers at once (keep-alive), no
retryd asked (a fast call never asks; the client's target is a closed port):

- ``plain``: ``request_with_retries`` with hedging off (the caller's thread
  sends, a pooled connection);
- ``hedged``: hedging on with a delay of 1 s that never fires: the first
  attempt runs on a worker thread (retryd._thread_copy.WORKERS), which is
  what makes a loser endable;
- ``owned``: the alternative of sending on a connection the adapter owns
  (so that it can close it): one fresh connection per call, measured as a
  plain ``httpx`` GET on a new ``HTTPTransport`` sharing one SSL context
  (building a context per call would add about 19 ms).

Then ``end``: how long a loser takes to end once cancelled, its request
held by the server: from ``ThreadCopyGate.cancel()`` (the socket shut down)
to its worker's return (the connection closed and out of the pool).

Run: ``.venv/bin/python tools/bench_hedged_call_sync.py`` (from clients/python).
Prints µs per call, the best of 10 interleaved rounds of 300 sequential
calls, and the median and worst of 50 ends.
"""

from __future__ import annotations

import ssl
import statistics
import threading
import time
from concurrent.futures import wait
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from retryd import Client, Idempotency
from retryd import _thread_copy
from retryd.hedging import Hedging
from retryd.httpx import _copy, request_with_retries

ROUNDS = 10
N = 300
ENDS = 50


class _Ok(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/hold":
            time.sleep(5)  # until the client shuts the connection (the write then fails)
        # One write: headers and body in separate segments would wait on
        # the client's delayed ACK (40 ms a call).
        self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    client = Client("127.0.0.1:1", timeout=0.2, connect_timeout=0.1, report_interval=3600)
    client.hedging.update([Hedging("hedged", True, 1.0, 1, frozenset({int(Idempotency.SAFE)}))])
    with httpx.Client() as http:

        def adapter(upstream: str) -> None:
            request_with_retries(http, client, "GET", url, upstream=upstream, idempotency=Idempotency.SAFE)

        context = ssl.create_default_context()

        def owned() -> None:
            with httpx.Client(transport=httpx.HTTPTransport(verify=context)) as fresh:
                fresh.get(url).read()

        runs = {"plain": lambda: adapter("plain"), "hedged": lambda: adapter("hedged"), "owned": owned}
        fastest = {name: float("inf") for name in runs}
        for _ in range(ROUNDS):  # interleaved, so that a busy machine's bad moments hit all three
            for name, run in runs.items():
                started = time.perf_counter()
                for _ in range(N):
                    run()
                fastest[name] = min(fastest[name], time.perf_counter() - started)
        for name, seconds in fastest.items():
            print(f"{name:<8} {seconds / N * 1e6:8.1f} µs per call")

        ends = []
        pool = http._transport._pool  # type: ignore[attr-defined]
        for _ in range(ENDS):
            request = http.build_request("GET", url + "hold")
            gate = _thread_copy.ThreadCopyGate(request, pool)
            future = _thread_copy.WORKERS.submit(lambda: _copy(http, request, {}, frozenset()))
            while gate.phase != "io":
                time.sleep(0.0005)
            time.sleep(0.005)  # in the read of the response headers
            started = time.perf_counter()
            gate.cancel()
            wait([future])
            ends.append(time.perf_counter() - started)
        print(f"end      {statistics.median(ends) * 1e6:8.1f} µs median, {max(ends) * 1e6:.1f} µs worst "
              f"(cancel to the loser's end, {ENDS} held requests)")
    client.close()
    server.shutdown()


if __name__ == "__main__":
    main()
