"""Fetch SIMDe's headers (SIMD Everywhere, github.com/simd-everywhere/simde, MIT licence) for
the kernels' ``avx512-emulated`` build (``engine/cpu_kernels.py``; ``make
test-avx512-emulated`` runs the kernel tests on it, so a CPU without avx512f checks the
AVX-512 functions' results).

The headers come from Debian's ``libsimde-dev`` 0.8.2-3 package (a package archive, as pip's
index is for the Python dependencies), checked against its SHA-256; its ``usr/include/simde``
is unpacked into ``cpu_kernels.simde_include()``. Run as a script: prints that folder and exits
0, or prints why not and exits 1. Nothing is fetched when the headers are already there.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from engine.cpu_kernels import has_simde, simde_include  # noqa: E402

URL = "http://deb.debian.org/debian/pool/main/s/simde/libsimde-dev_0.8.2-3_all.deb"
SHA256 = "277dcde3fb84223b7026174042646e236da42adce2fcb77031807ede8166a51e"
PREFIX = "./usr/include/"


def deb_member(deb: bytes, name: str) -> bytes:
    """One member of a .deb (an ``ar`` archive: 8-byte magic, then per member a 60-byte
    header whose bytes 48-58 give its size in decimal, its data, padded to an even length).

    Raises:
        ValueError: not an ar archive, or no member ``name``.
    """
    if not deb.startswith(b"!<arch>\n"):
        raise ValueError("not a .deb (ar) archive")
    at = 8
    while at + 60 <= len(deb):
        header = deb[at:at + 60]
        size = int(header[48:58].decode().strip())
        if header[:16].decode().strip().rstrip("/") == name:
            return deb[at + 60:at + 60 + size]
        at += 60 + size + size % 2
    raise ValueError(f"no {name} in the archive")


def fetch(target: Path) -> None:
    """Download, check and unpack the headers into ``target`` (``target/simde/...``).

    Raises:
        OSError: the download failed.
        ValueError: the file's SHA-256 is not the pinned one, or it is not the package.
    """
    with urllib.request.urlopen(URL, timeout=60) as response:
        deb = response.read()
    digest = hashlib.sha256(deb).hexdigest()
    if digest != SHA256:
        raise ValueError(f"{URL}: SHA-256 {digest}, expected {SHA256}")
    data = tarfile.open(fileobj=io.BytesIO(deb_member(deb, "data.tar.xz")), mode="r:xz")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent))
    try:
        for member in data.getmembers():
            if member.name.startswith(PREFIX + "simde/") and (member.isfile() or member.isdir()):
                member.name = member.name[len(PREFIX):]
                data.extract(member, staging, filter="data")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)  # whole or not at all: a cut-off fetch leaves no half folder
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def main() -> int:
    target = simde_include()
    if not has_simde(target):
        try:
            fetch(target)
        except (OSError, ValueError, tarfile.TarError) as e:
            print(f"SIMDe headers not fetched ({e})", file=sys.stderr)
            return 1
    print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
