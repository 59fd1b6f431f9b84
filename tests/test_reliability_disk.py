"""A disk that fails under the server: one unreadable region of a shard.

The failing device is built here: an ext4 on a loop device over a sparse file,
the checkpoint written to it, mounted read-only, and then the device's
capacity cut under the running servers (the backing file truncated,
``losetup -c``): every block past the cut returns EIO, as a failing disk's
bad region does. (Device-mapper's ``error`` target would do the same, but
not every kernel has device-mapper.)

Requests for rows in that region fail with ``read_error`` naming the file and
the offset, in every io mode — in mmap mode the read is a page fault that
raises SIGBUS, which used to kill the server — while every other row is still
served bit-exact. A server started on that disk fails its start-up with the
file and offset its fingerprint could not read. Needs root and loop devices;
skipped elsewhere, with the reason.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import struct
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from pleclient import RequestError
from pleclient.checkpoint import discover_tables
from pleserver.devkit.synthetic import SyntheticTable, read_reference, write_checkpoint

TABLES = (
    SyntheticTable(layer=1, rows=40_009, cols=160, dtype="F8_E4M3", parts=4, scale=0.0125),
    SyntheticTable(layer=5, rows=30_011, cols=160, dtype="NVFP4", parts=3, scale=0.375),
)
DEVICE_BYTES = 96 << 20
FS_BLOCK = 4096


def run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


class CutDisk:
    """An ext4 on a loop device, mounted at ``mount``; ``cut(at)`` makes every
    device byte from ``at`` on unreadable (EIO)."""

    def __init__(self, root: Path) -> None:
        self.image = root / "disk.img"
        self.mount = root / "mnt"
        self.device: str | None = None
        self.mounted = False

    def setup(self) -> None:
        if os.geteuid() != 0:
            pytest.skip("needs root to set up a loop device")
        for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
            if shutil.which(tool) is None:
                pytest.skip(f"needs {tool}")
        with open(self.image, "wb") as f:
            f.truncate(DEVICE_BYTES)
        made = run("losetup", "--find", "--show", str(self.image))
        if made.returncode != 0:
            pytest.skip(f"no loop device available: {made.stderr.strip()}")
        self.device = made.stdout.strip()
        fs = run("mkfs.ext4", "-q", "-F", "-b", str(FS_BLOCK), "-E", "nodiscard", self.device)
        assert fs.returncode == 0, fs.stderr
        self.mount.mkdir()
        self._mount("rw")

    def _mount(self, mode: str) -> None:
        assert self.device is not None
        done = run("mount", "-o", mode, self.device, str(self.mount))
        if done.returncode != 0:
            pytest.skip(f"cannot mount an ext4 here: {done.stderr.strip()}")
        self.mounted = True

    def remount_read_only(self) -> None:
        """Unmount (the page cache of its files goes) and mount read-only: the
        journal is never written once the device is cut."""
        assert run("umount", str(self.mount)).returncode == 0
        self.mounted = False
        self._mount("ro")

    def cut(self, at: int) -> None:
        """Device bytes from ``at`` on fail with EIO from now on."""
        assert self.device is not None
        os.truncate(self.image, at)
        done = run("losetup", "--set-capacity", self.device)
        assert done.returncode == 0, done.stderr

    def close(self) -> None:
        if self.mounted:
            for _ in range(50):  # a server's files may be closing still
                if run("umount", str(self.mount)).returncode == 0:
                    break
                time.sleep(0.1)
            else:
                run("umount", "--lazy", str(self.mount))
        if self.device:
            run("losetup", "--detach", self.device)
        self.image.unlink(missing_ok=True)


@pytest.fixture
def disk(tmp_path):
    d = CutDisk(tmp_path)
    try:
        d.setup()
        yield d
    finally:
        d.close()


# FS_IOC_FIEMAP: where each extent of a file lies on its device.
FS_IOC_FIEMAP = 0xC020660B
FIEMAP_FLAG_SYNC = 1
FIEMAP_HEADER = struct.Struct("=QQIIII")
FIEMAP_EXTENT = struct.Struct("=QQQQQI12x")


def extents(path: str) -> list[tuple[int, int, int]]:
    """(file offset, device offset, length) of every extent of ``path``."""
    count = 256
    buf = bytearray(FIEMAP_HEADER.pack(0, 2**64 - 1, FIEMAP_FLAG_SYNC, 0, count, 0))
    buf += bytes(count * FIEMAP_EXTENT.size)
    with open(path, "rb") as f:
        fcntl.ioctl(f.fileno(), FS_IOC_FIEMAP, buf)
    mapped = FIEMAP_HEADER.unpack_from(buf)[3]
    assert mapped < count, f"{path} has {mapped} extents"
    out = []
    for k in range(mapped):
        logical, physical, length, _, _, _ = FIEMAP_EXTENT.unpack_from(
            buf, FIEMAP_HEADER.size + k * FIEMAP_EXTENT.size
        )
        out.append((logical, physical, length))
    return out


def device_offset(file_extents: list[tuple[int, int, int]], offset: int) -> int:
    for logical, physical, length in file_extents:
        if logical <= offset < logical + length:
            return physical + offset - logical
    raise AssertionError(f"file offset {offset} is in no extent")


def lost_rows(spec, file_extents: dict, cut: int) -> np.ndarray:
    """Ids of ``spec`` with a byte in a file-system block past the cut."""
    lost = np.zeros(spec.rows, dtype=bool)
    for segment in spec.segments:
        for index, shard in enumerate(segment.shards):
            first = index * spec.shard_size
            for r in range(shard.rows):
                start = shard.offset + r * segment.row_bytes
                end = start + segment.row_bytes - 1
                for at in {start - start % FS_BLOCK, end - end % FS_BLOCK}:
                    if device_offset(file_extents[shard.path], at) >= cut:
                        lost[first + r] = True
    return np.flatnonzero(lost)


def test_an_unreadable_region_fails_its_requests_not_the_server(disk, start_server, tmp_path):
    model = str(disk.mount / "model")
    write_checkpoint(model, TABLES, files=2)
    os.sync()
    specs = {s.layer: s for s in discover_tables(model, fingerprint=False)}
    paths = sorted({p for s in specs.values() for p in s.files})
    where = {p: extents(p) for p in paths}
    # Cut inside the last shard of the FP8 table, past its middle row: that
    # row (which the fingerprint samples) is lost, and whatever lies after.
    fp8 = specs[1]
    last = fp8.shards[-1]
    middle = last.offset + (last.rows // 2 - 50) * fp8.row_bytes
    cut = device_offset(where[last.path], middle)
    cut -= cut % FS_BLOCK
    lost = {layer: lost_rows(spec, where, cut) for layer, spec in specs.items()}
    kept = {layer: np.setdiff1d(np.arange(spec.rows), lost[layer]) for layer, spec in specs.items()}
    assert lost[1].size > 0 and kept[1].size > 0, (lost, cut)
    disk.remount_read_only()
    references = {layer: read_reference(model, spec.name) for layer, spec in specs.items()}
    servers = {
        io: start_server(model, "--io", io, "--cache-size", "4M", "--state-dir", str(tmp_path))
        for io in ("mmap", "direct", "buffered")
    }
    for server in servers.values():  # a row of each table before the cut: all well
        with server.client() as client:
            for layer in specs:
                assert np.array_equal(
                    client.lookup(layer, kept[layer][:1]), references[layer][kept[layer][:1]]
                )
    disk.cut(cut)
    for path in paths:  # what the page cache holds of the files goes too
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    rng = np.random.default_rng(3)
    for io, server in servers.items():
        with server.client() as client:
            for layer in specs:
                if lost[layer].size == 0:
                    continue
                for ids in (
                    lost[layer][:1],
                    rng.choice(lost[layer], 40),
                    np.concatenate([kept[layer][:10], lost[layer][-1:]]),
                ):
                    with pytest.raises(RequestError, match="reading rows failed") as caught:
                        client.lookup(layer, ids)
                    text = str(caught.value)
                    assert "offset" in text and any(p in text for p in paths), text
                ids = rng.choice(kept[layer], 3000)
                assert np.array_equal(client.lookup(layer, ids), references[layer][ids]), io
            stats = client.stats()
        errors = sum(t["errors"].get("read_error", 0) for t in stats["tables"])
        print(f"{io}: {errors} read_error answers; the server serves on")
        assert errors >= 3
        assert server.proc.poll() is None, server.log_tail()
    for server in servers.values():
        assert server.stop() == 0, server.log_tail()
    # A restart on that disk: the fingerprint's sampled row is unreadable.
    again = start_server(model, "--io", "mmap", wait=False)
    assert again.exit_code() == 2
    log = again.log()
    assert "Input/output error" in log and "offset" in log and last.path in log, log[-3000:]
