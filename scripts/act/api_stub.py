"""A stand-in for the GitHub REST API on 127.0.0.1, for the GPU job's pull-request leg under act on a
machine with no network (scripts/act/gpu-job.sh --event pull_request_target).

    python3 scripts/act/api_stub.py [--log FILE]

Prints its base URL (http://127.0.0.1:PORT) on the first line of stdout, then serves until it is
killed. What the leg's approve step asks on the fake PR #1's `synchronize` (scripts/act/actlog.py
event) gets GitHub's answer for a pull request with no label and no comments: removing the label
404, listing the comments an empty list. Anything else is 404 too, so a step that needs more from
the API fails as it would against a repository that lacks it. --log appends each call, one line
each: METHOD PATH.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# (method, path pattern under /repos/OWNER/NAME/) -> (status, JSON answer)
ROUTES = (
    ("GET", re.compile(r"issues/\d+/comments(\?.*)?$"), 200, []),
    ("DELETE", re.compile(r"issues/\d+/labels/[^/]+$"), 404, {"message": "Label does not exist"}),
)
NOT_FOUND = (
    404,
    {"message": "Not Found (scripts/act/api_stub.py answers only what act's PR leg asks)"},
)


def answer(method: str, path: str) -> tuple[int, object]:
    """The status and JSON body for METHOD /repos/OWNER/NAME/PATH (any other path: 404)."""
    match = re.match(r"^/repos/[^/]+/[^/]+/(.*)$", path)
    if match:
        for route_method, pattern, status, body in ROUTES:
            if route_method == method and pattern.match(match[1]):
                return status, body
    return NOT_FOUND


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", help="append each call here: METHOD PATH")
    args = parser.parse_args()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self):
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            if args.log:
                with open(args.log, "a", encoding="utf-8") as log:
                    log.write(f"{self.command} {self.path}\n")
            status, body = answer(self.command, self.path)
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _answer

        def log_message(self, *_):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(f"http://127.0.0.1:{server.server_address[1]}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
