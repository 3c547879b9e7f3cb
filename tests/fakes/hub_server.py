"""A fake model hub on 127.0.0.1 for the hub-id tests: the endpoints huggingface_hub 2.x calls to download a
file or a snapshot (HEAD/GET /{repo}/resolve/{revision}/{file}, GET /api/models/{repo}/revision/{revision} and its /tree),
with its headers (X-Repo-Commit, ETag, Content-Length) and its error codes (X-Error-Code: GatedRepo,
RepoNotFound, EntryNotFound), as huggingface_hub's hf_raise_for_status reads them. Nothing reaches a real hub.

``repos`` maps "org/name" to {filename: bytes}; "gated" marks a repository behind a licence.
"""
from __future__ import annotations

import hashlib
import threading
from http.server import ThreadingHTTPServer
from urllib.parse import unquote

from ._http import Handler

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, bytes]], gated: set[str] = frozenset()):
        self.repos, self.gated = repos, set(gated)
        self.requests: list[str] = []
        hub = self

        class HubHandler(Handler):
            def do_HEAD(self):
                hub.handle(self)

            def do_GET(self):
                hub.handle(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), HubHandler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def error(self, h: Handler, status: int, code: str, message: str) -> None:
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        body = ('{"error":"%s"}' % message).encode()
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)

    def handle(self, h: Handler) -> None:
        path = unquote(h.path.split("?")[0])
        self.requests.append(f"{h.command} {path}")
        if path.startswith("/api/models/"):
            rest = path[len("/api/models/"):].split("/")
            repo = "/".join(rest[:2])
            if repo not in self.repos:
                return self.error(h, 404, "RepoNotFound", "Repository not found")
            files = sorted(self.repos[repo])
            if rest[2:3] == ["tree"]:  # list_repo_tree: one page of entries
                return h.send_json(200, [{"type": "file", "path": f, "size": len(self.repos[repo][f]),
                                          "oid": hashlib.sha1(self.repos[repo][f]).hexdigest()} for f in files])
            return h.send_json(200, {"id": repo, "sha": COMMIT, "siblings": [{"rfilename": f} for f in files]})
        parts = path.lstrip("/").split("/")
        if len(parts) < 5 or parts[2] != "resolve":
            return self.error(h, 404, "RepoNotFound", "Repository not found")
        repo, filename = "/".join(parts[:2]), "/".join(parts[4:])
        if repo not in self.repos:
            return self.error(h, 401, "RepoNotFound", "Repository not found")
        if repo in self.gated:
            return self.error(h, 403, "GatedRepo", f"Access to model {repo} is restricted. You must have access "
                                                   "to it and be authenticated to access it. Please log in.")
        content = self.repos[repo].get(filename)
        if content is None:
            return self.error(h, 404, "EntryNotFound", f"{filename} does not exist on main")
        h.send_response(200)
        h.send_header("X-Repo-Commit", COMMIT)
        h.send_header("ETag", f'"{hashlib.sha256(content).hexdigest()}"')
        h.send_header("Content-Length", str(len(content)))
        h.send_header("Content-Type", "application/octet-stream")
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(content)
