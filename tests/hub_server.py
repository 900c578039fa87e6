"""A loopback stand-in for the Hugging Face Hub's file routes, serving Hub-layout folders from disk.

Answers ``HEAD`` / ``GET /{org}/{repo}/resolve/{revision}/{filename}`` with the headers ``hf_hub_download`` insists on
(``X-Repo-Commit``, ``ETag``, ``Content-Length``) and the Hub's 404 error codes, so that the real download code of
``huggingface_hub`` runs against it. Each revision maps to a folder of repo folders (``main`` → ``weights/``), which
lets a test serve a tampered revision beside the good one. Every request is recorded.
"""
import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Dict, List, Tuple


class HubServer:
    def __init__(self, org: str, revisions: Dict[str, Path]):
        self.org = org
        self.revisions = revisions
        self.requests: List[Tuple[str, str]] = []
        self._server = ThreadingHTTPServer(('127.0.0.1', 0), self._handler())
        self.endpoint = f'http://127.0.0.1:{self._server.server_address[1]}'
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> 'HubServer':
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_HEAD(self):
                self._serve(send_body=False)

            def do_GET(self):
                self._serve(send_body=True)

            def _serve(self, send_body: bool):
                hub.requests.append((self.command, self.path))
                parts = self.path.split('?')[0].strip('/').split('/')
                if len(parts) < 5 or parts[2] != 'resolve' or parts[0] != hub.org:
                    return self._error(404, 'RepoNotFound', commit=None)
                repo, revision, filename = parts[1], parts[3], '/'.join(parts[4:])
                if revision not in hub.revisions:
                    return self._error(404, 'RevisionNotFound', commit=None)
                commit = revision if len(revision) == 40 else hashlib.sha1(revision.encode()).hexdigest()
                repo_dir = hub.revisions[revision] / repo
                if not repo_dir.is_dir():
                    return self._error(404, 'RepoNotFound', commit=None)
                path = repo_dir / filename
                if not path.is_file():
                    return self._error(404, 'EntryNotFound', commit=commit)
                body = path.read_bytes()
                self.send_response(200)
                self.send_header('X-Repo-Commit', commit)
                self.send_header('ETag', f'"{hashlib.sha256(body).hexdigest()}"')
                self.send_header('Content-Length', str(len(body)))
                self.send_header('Content-Type', 'application/octet-stream')
                self.end_headers()
                if send_body:
                    self.wfile.write(body)

            def _error(self, status: int, code: str, commit):
                self.send_response(status)
                self.send_header('X-Error-Code', code)
                if commit:
                    self.send_header('X-Repo-Commit', commit)
                self.send_header('Content-Length', '0')
                self.end_headers()

        return Handler
