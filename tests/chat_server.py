"""A small OpenAI-compatible chat-completions server for the labelling tests and the simulated-LLM
benchmark: answers come from a table (text -> answer) or a test's own ``reply`` function, which may
also send malformed answers, 429s, 500s, slow replies, another schema or hang.

As a script: ``python tests/chat_server.py --table table.jsonl --port 8089`` serves a JSONL table of
``{"text", "answer"}`` lines (the text is found after the prompt's last ``Text: ``).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def text_of(prompt: str) -> str:
    """The labelled text inside a prompt made from encoderkit's default template."""
    tail = prompt.rsplit("Text: ", 1)[-1]
    for cue in ("\nLabel:", "\nLabels:", "\nEntities:"):  # classify, multilabel, ner
        tail = tail.rsplit(cue, 1)[0]
    return tail


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that gave up (timeout test) leaves a broken pipe; not worth a traceback


class ChatServer:
    """``reply(text, n_for_text, body) -> str | ("status", code) | ("sleep", s, answer) | ("raw", dict)
    | ("hang",)``."""

    def __init__(self, reply: Callable[[str, int, dict], Any], port: int = 0) -> None:
        self.reply = reply
        self.requests: list[str] = []   # text of every request received
        self.answered: list[str] = []   # text of every 200 answer sent
        self.lock = threading.Lock()
        self.release = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/chat/completions":
                    return self._send(404, {"error": {"message": f"no route {self.path}"}})
                prompt = body["messages"][-1]["content"]
                text = text_of(prompt)
                with server.lock:
                    server.requests.append(text)
                    n = server.requests.count(text)
                out = server.reply(text, n, body)
                if isinstance(out, tuple) and out[0] == "hang":
                    server.release.wait(60)
                    return self._send(503, {"error": {"message": "gone"}})
                if isinstance(out, tuple) and out[0] == "status":
                    return self._send(out[1], {"error": {"message": f"status {out[1]}"}})
                if isinstance(out, tuple) and out[0] == "raw":
                    return self._send(200, out[1])
                if isinstance(out, tuple) and out[0] == "sleep":
                    time.sleep(out[1])
                    out = out[2]
                with server.lock:
                    server.answered.append(text)
                self._send(200, {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                                 "choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant", "content": out}}],
                                 "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": 1,
                                           "total_tokens": len(prompt.split()) + 1}})

            def _send(self, code: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = _QuietServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> ChatServer:  # noqa: PYI034 -- no Self on Python 3.10
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--table", required=True)
    p.add_argument("--port", type=int, default=8089)
    a = p.parse_args()
    table = {}
    with open(a.table, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            table[rec["text"]] = rec["answer"]
    with ChatServer(lambda text, n, body: table.get(text, "unknown"), a.port) as srv:
        print(f"serving {len(table)} answers on {srv.url}", flush=True)
        srv.thread.join()


if __name__ == "__main__":
    main()
