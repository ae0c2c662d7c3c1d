"""A stand-in for the Hugging Face Hub on 127.0.0.1, for HF_ENDPOINT: the endpoints and headers
the hub's client (``huggingface_hub``) uses to list a repository and download from it.

- ``GET /api/models/OWNER/REPO?blobs=True``: the model info, its commit (``sha``) and every file
  (``siblings``) with its size, git blob id and, for GGUFs, the LFS SHA-256 the client is to match;
- ``HEAD``/``GET /OWNER/REPO/resolve/REVISION/PATH``: a file, with ``X-Repo-Commit``,
  ``X-Linked-Etag`` (its SHA-256), ``X-Linked-Size`` and ``ETag``, and ``Range`` requests
  (206), which is how the client resumes a download that broke off;
- 404 with ``X-Error-Code: RepoNotFound`` for an unknown repository, 401 for a private one
  asked for without its token (``Authorization: Bearer``).

Each file can be served whole, cut off once part-way (the connection drops after that fraction
of its bytes), or tampered with (other bytes than the listing's SHA-256 stands for).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import gguf
from aiohttp import web

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class HubFile:
    data: bytes
    # Drop the connection after this fraction of the bytes, on the first whole-file GET only.
    cut_at: float | None = None
    # Serve these bytes instead, with the listing and headers still those of ``data``.
    served: bytes | None = None

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


@dataclass
class Repo:
    files: dict[str, HubFile]
    # The token a private repository asks for; None: public.
    token: str | None = None
    # Files listed, and never served (only their names matter).
    listed_only: dict[str, int] = field(default_factory=dict)


class HubStandIn:
    def __init__(self, repos: dict[str, Repo]):
        self.repos = repos
        # (method, path, Range header) of every request, in order.
        self.requests: list[tuple[str, str, str | None]] = []
        app = web.Application()
        app.add_routes(
            [
                web.get("/api/models/{owner}/{repo}", self._info),
                web.route("*", "/{owner}/{repo}/resolve/{revision}/{path:.+}", self._resolve),
            ]
        )
        self.app = app
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        self.runner = web.AppRunner(self.app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    def _repo(self, request: web.Request) -> tuple[Repo | None, web.Response | None]:
        self.requests.append((request.method, request.path, request.headers.get("Range")))
        repo = self.repos.get(f"{request.match_info['owner']}/{request.match_info['repo']}")
        if repo is None:
            return None, web.Response(status=404, headers={"X-Error-Code": "RepoNotFound"})
        if repo.token is not None and request.headers.get("Authorization") != f"Bearer {repo.token}":
            return None, web.Response(status=401, headers={"X-Error-Message": "Invalid username or password."})
        return repo, None

    async def _info(self, request: web.Request) -> web.Response:
        repo, refused = self._repo(request)
        if refused is not None:
            return refused
        assert repo is not None
        siblings = [
            {
                "rfilename": path,
                "size": len(file.data),
                "blobId": hashlib.sha1(file.data).hexdigest(),
                "lfs": {"size": len(file.data), "sha256": file.sha256, "pointerSize": 134},
            }
            for path, file in repo.files.items()
        ]
        siblings += [
            {
                "rfilename": path,
                "size": size,
                "blobId": "0" * 40,
                "lfs": {"size": size, "sha256": "0" * 64, "pointerSize": 134},
            }
            for path, size in repo.listed_only.items()
        ]
        return web.json_response({"id": request.path.split("/api/models/", 1)[1], "sha": COMMIT, "siblings": siblings})

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        repo, refused = self._repo(request)
        if refused is not None:
            return refused
        assert repo is not None
        file = repo.files.get(request.match_info["path"])
        if file is None:
            return web.Response(status=404, headers={"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT})
        body = file.served if file.served is not None else file.data
        headers = {
            "X-Repo-Commit": COMMIT,
            "X-Linked-Etag": f'"{file.sha256}"',
            "X-Linked-Size": str(len(file.data)),
            "ETag": f'"{file.sha256}"',
            "Accept-Ranges": "bytes",
        }
        if request.method == "HEAD":
            return web.Response(headers={**headers, "Content-Length": str(len(body))})
        start = 0
        ranged = request.headers.get("Range")
        if ranged is not None:
            start = int(ranged.removeprefix("bytes=").split("-")[0])
            headers["Content-Range"] = f"bytes {start}-{len(body) - 1}/{len(body)}"
        response = web.StreamResponse(status=206 if ranged else 200, headers=headers)
        response.content_length = len(body) - start
        await response.prepare(request)
        end = len(body)
        cut = file.cut_at is not None and ranged is None
        if cut:
            file.cut_at, end = None, int(len(body) * file.cut_at)
        for offset in range(start, end, 1 << 20):
            await response.write(body[offset : min(offset + (1 << 20), end)])
        if cut:
            # The connection breaks off mid-file, as a network does.
            assert request.transport is not None
            request.transport.abort()
            return response
        await response.write_eof()
        return response


def split_gguf(source: Path, first_part: Path) -> list[Path]:
    """``source`` rewritten as a GGUF split in two, as llama.cpp's gguf-split writes one:
    ``NAME-00001-of-00002.gguf`` with the metadata and half the tensors, then the rest.
    ``first_part`` names the first part's folder and NAME (NAME.gguf)."""
    reader = gguf.GGUFReader(str(source))
    tensors = list(reader.tensors)
    architecture = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(first_part, arch=architecture, split_max_tensors=(len(tensors) + 1) // 2)
    for item in reader.fields.values():
        if item.name == gguf.Keys.General.ARCHITECTURE or item.name.startswith("GGUF."):
            continue
        value_type = item.types[0]
        sub_type = item.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(item.name, item.contents(), value_type, sub_type=sub_type)
    for tensor in tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(first_part.parent.glob(f"{first_part.stem}-0000*-of-00002.gguf"))
