"""What software a process runs: the package version and a digest of its code.

A worker reports both when it registers; meta admits it only at a version
`settings.allowed_versions` lists (when it lists any), and `topoctl status`
shows both, so two workers that claim one version but run different code
(a hot-patched file, a half-finished deploy) stand out.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

# The packages of this distribution (setup.cfg [options.packages.find]).
PACKAGES = ("shardgrid", "topology", "meta", "worker", "gateway")


@dataclass(frozen=True)
class SoftwareIdentity:
    version: str
    code_digest: str  # sha256 over every .py file of PACKAGES, by relative path, hex (first 16 bytes)


def package_version() -> str:
    try:
        return metadata.version("shardgrid")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def code_digest(root: Path | None = None) -> str:
    """Digest of the installed code; files are taken in path order so every install of one tree agrees."""
    base = root if root is not None else Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for pkg in PACKAGES:
        for path in sorted((base / pkg).rglob("*.py")):
            h.update(str(path.relative_to(base)).encode() + b"\0")
            h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:32]


def current() -> SoftwareIdentity:
    return SoftwareIdentity(package_version(), code_digest())
