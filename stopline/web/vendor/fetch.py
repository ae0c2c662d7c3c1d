"""Fetch the browser libraries in stopline/web/vendor/ from the npm registry, verified.

    python stopline/web/vendor/fetch.py            # fetch; every tarball must match vendor.json
    python stopline/web/vendor/fetch.py --record   # after changing a version: record the new integrity

Each package in vendor.json is pinned to an exact version and to the sha512
integrity of its tarball. The script runs ``npm pack`` for that version,
hashes the tarball itself, refuses any mismatch, and copies out the listed
files (the minified build and its LICENSE). It then prints the sha384
``integrity=`` value of each shipped script and stylesheet; index.html loads
them with exactly these values (tests/test_web.py checks that they agree).
"""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOCK = HERE / "vendor.json"


def sri(data: bytes, algorithm: str) -> str:
    return f"{algorithm}-{base64.b64encode(hashlib.new(algorithm, data).digest()).decode()}"


def fetch(record: bool) -> int:
    lock = json.loads(LOCK.read_text())
    with tempfile.TemporaryDirectory() as temp:
        for package in lock["packages"]:
            spec = f"{package['name']}@{package['version']}"
            packed = subprocess.run(
                ["npm", "pack", spec, "--json", "--pack-destination", temp], check=True, capture_output=True, text=True
            )
            [info] = json.loads(packed.stdout)
            tarball = Path(temp) / info["filename"]
            integrity = sri(tarball.read_bytes(), "sha512")
            if integrity != info["integrity"]:
                sys.exit(f"{spec}: tarball hashes to {integrity}, the registry says {info['integrity']}")
            if record:
                package["integrity"] = integrity
            elif integrity != package["integrity"]:
                sys.exit(f"{spec}: tarball hashes to {integrity}, vendor.json pins {package['integrity']}")
            with tarfile.open(tarball) as archive:
                for member, shipped in package["files"].items():
                    extracted = archive.extractfile(member)
                    if extracted is None:
                        sys.exit(f"{spec}: {member} is not a file in the tarball")
                    (HERE / shipped).write_bytes(extracted.read())
            print(f"{spec} {integrity}")
    if record:
        LOCK.write_text(json.dumps(lock, indent=2) + "\n")
    for package in lock["packages"]:
        for shipped in package["files"].values():
            if shipped.endswith((".js", ".css")):
                print(f'  {shipped}: integrity="{sri((HERE / shipped).read_bytes(), "sha384")}"')
    return 0


if __name__ == "__main__":
    sys.exit(fetch(record="--record" in sys.argv[1:]))
