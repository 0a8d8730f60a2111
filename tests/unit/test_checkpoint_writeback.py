"""A save's write stream hands the disk what it wrote every 32 MiB
(`digests.start_writeback`): the file and its digest are those of the bytes written."""

from __future__ import annotations

import os

import xxhash

from disttrain.checkpoint import digests


def test_a_stream_past_the_writeback_size_writes_and_hashes_every_byte(tmp_path):
    chunk = os.urandom(1 << 20)
    seen = {}
    with open(tmp_path / "f", "wb") as raw:
        stream = digests.HashingStream(raw, lambda length, size, digest: seen.update(length=length, digest=digest))
        for _ in range(40):  # 40 MiB: one writeback handed over mid-stream
            stream.write(chunk)
        assert stream._handed == 32 << 20
        stream.close()
    data = (tmp_path / "f").read_bytes()
    assert data == chunk * 40 and seen == {"length": len(data), "digest": xxhash.xxh3_128_hexdigest(data)}
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        digests.start_writeback(fd, 0, 0)  # nothing to hand over: no call
    finally:
        os.close(fd)
