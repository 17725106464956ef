"""A reward server on 127.0.0.1 for the tests: answers a batch with one reward per completion (the share
of digits in it), checks the bearer token, and misbehaves on demand (`fault`): a wrong count, non-numbers,
HTTP 500 a number of times, or no answer at all."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class RewardServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, token: str | None = None):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.token, self.fault, self.fault_times, self.batches = token, None, 0, []
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/score"

    def misbehave(self, fault: str, times: int = 1_000_000) -> None:
        self.fault, self.fault_times = fault, times

    def __enter__(self) -> RewardServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        server: RewardServer = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if server.token and self.headers.get("Authorization") != f"Bearer {server.token}":
            return self._send(401, {"error": "bad token"})
        server.batches.append(body)
        completions = body["completions"]
        rewards = [sum(c.isdigit() for c in text) / max(1, len(text)) for text in completions]
        fault = server.fault if server.fault_times > 0 else None
        if fault:
            server.fault_times -= 1
        if fault == "500":
            return self._send(500, {"error": "internal"})
        if fault == "count":
            rewards = rewards[:-1]
        if fault == "text":
            rewards = ["high"] * len(rewards)
        self._send(200, {"rewards": rewards})

    def _send(self, status: int, payload) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
