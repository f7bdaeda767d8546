"""A local fake e-mail provider **without deduplication**: every accepted send is a new e-mail.

It records each send with the caller's ``reference`` (our downstream idempotency key), so the
example can reconcile by asking it. It can be told to misbehave, as real providers do:

* ``slow_sends``: the next N sends are accepted (recorded) and then answered only after ``delay``
  seconds: the caller times out although the e-mail went out;
* ``lookups_down``: lookups answer 503: the caller cannot tell whether a send happened.

HTTP API (JSON):

* ``POST /v1/messages`` ``{"to", "template", "reference"}`` -> ``202 {"id": "msg-N"}``
* ``GET /v1/messages?reference=R`` -> ``200 {"messages": [{"id", "reference", "to", "template"}]}``
* ``POST /_control`` ``{"slow_sends": N, "delay": seconds, "lookups_down": bool}`` -> ``204``
* ``GET /_sent`` -> ``200 {"messages": [...]}`` (everything accepted so far)

Run it on its own with ``python -m examples.notifications.provider --port 8025``.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


class FakeProvider:
    """The provider's state and its HTTP server (a background thread on 127.0.0.1)."""

    def __init__(self, port: int = 0) -> None:
        self.sent: list[dict[str, Any]] = []
        self.slow_sends = 0
        self.delay = 0.0
        self.lookups_down = False
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", port), _handler_for(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeProvider:
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-provider", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def accept(self, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
        """Record one send; returns it and how long to wait before answering."""
        with self._lock:
            message = {"id": f"msg-{len(self.sent) + 1}", "reference": body.get("reference"),
                       "to": body.get("to"), "template": body.get("template")}
            self.sent.append(message)
            wait = 0.0
            if self.slow_sends > 0:
                self.slow_sends -= 1
                wait = self.delay
        return message, wait

    def find(self, reference: str) -> list[dict[str, Any]]:
        with self._lock:
            return [m for m in self.sent if m["reference"] == reference]


def _handler_for(provider: FakeProvider) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # quiet: the example logs ids itself
            pass

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            path = urlsplit(self.path).path
            if path == "/v1/messages":
                message, wait = provider.accept(body)
                if wait:
                    time.sleep(wait)  # accepted, then slow: the caller gives up first
                self._answer(202, {"id": message["id"]})
            elif path == "/_control":
                provider.slow_sends = int(body.get("slow_sends", provider.slow_sends))
                provider.delay = float(body.get("delay", provider.delay))
                provider.lookups_down = bool(body.get("lookups_down", provider.lookups_down))
                self._answer(204, None)
            else:
                self._answer(404, {"error": "not found"})

        def do_GET(self) -> None:
            parts = urlsplit(self.path)
            if parts.path == "/v1/messages":
                if provider.lookups_down:
                    self._answer(503, {"error": "lookups unavailable"})
                    return
                reference = parse_qs(parts.query).get("reference", [""])[0]
                self._answer(200, {"messages": provider.find(reference)})
            elif parts.path == "/_sent":
                self._answer(200, {"messages": list(provider.sent)})
            else:
                self._answer(404, {"error": "not found"})

        def _answer(self, status: int, body: Any) -> None:
            payload = b"" if body is None else json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the caller timed out and left: the send stays recorded

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description="A fake e-mail provider without deduplication.")
    parser.add_argument("--port", type=int, default=8025)
    args = parser.parse_args()
    provider = FakeProvider(args.port).start()
    print(f"fake provider on {provider.url} (Ctrl-C to stop)")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        provider.stop()


if __name__ == "__main__":
    main()
