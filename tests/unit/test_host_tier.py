"""Unit tests for the cpu host tier: `Accelerator("cpu").host_empty` maps buffers from unlinked /dev/shm files.

Memory checks read /proc/self/status: a touched shared-memory buffer counts as `RssShmem`, not `RssAnon`
(the cpu backend's "device memory"). Bounds are loose (a quarter of the buffer) so other allocations in the
test process cannot flip them.
"""

import errno
import os
import tempfile
from pathlib import Path

import pytest
import torch

import internlm_offload.device.host_alloc as device_mod
from internlm_offload.device import Accelerator
from internlm_offload.device.cpu_memory import rss_anon_bytes, rss_shmem_bytes

MB = 1 << 20
PREFIX = "internlm_offload-"

pytestmark = pytest.mark.skipif(
    not os.access(device_mod.SHM_DIR, os.W_OK), reason=f"{device_mod.SHM_DIR} is not a writable directory"
)


@pytest.fixture
def acc() -> Accelerator:
    return Accelerator("cpu")


def _our_shm_files() -> set[str]:
    return {name for name in os.listdir(device_mod.SHM_DIR) if name.startswith(PREFIX)}


def _is_shm(t: torch.Tensor) -> bool:
    return t.untyped_storage().filename is not None


def test_buffer_counts_as_shmem_not_anon(acc: Accelerator) -> None:
    anon, shmem = rss_anon_bytes(), rss_shmem_bytes()
    buf = acc.host_empty((64 * MB,), torch.uint8)
    buf.fill_(1)  # touch every page
    assert _is_shm(buf)
    assert rss_shmem_bytes() - shmem > 56 * MB
    assert rss_anon_bytes() - anon < 16 * MB
    del buf
    assert rss_shmem_bytes() - shmem < 16 * MB  # the pages go with the last mapping


def test_memory_allocated_is_rss_anon(acc: Accelerator) -> None:
    before = acc.memory_allocated()
    host = acc.host_empty((64 * MB,), torch.uint8).fill_(1)
    after_host = acc.memory_allocated()
    dev = torch.ones(64 * MB, dtype=torch.uint8)
    after_dev = acc.memory_allocated()
    assert after_host - before < 16 * MB
    assert after_dev - after_host > 56 * MB
    del host, dev


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_round_trip_and_views(acc: Accelerator, dtype: torch.dtype) -> None:
    src = torch.randn(3, 5, 4096).to(dtype)
    buf = acc.host_empty(src.shape, dtype)
    assert _is_shm(buf) and buf.shape == src.shape and buf.dtype == dtype and buf.is_contiguous()
    buf.copy_(src)
    assert torch.equal(torch.empty_like(src).copy_(buf), src)
    assert torch.equal(buf.view(15, -1)[4], src.reshape(15, -1)[4])
    assert torch.equal(buf.transpose(0, 2)[::3], src.transpose(0, 2)[::3])
    buf[1].zero_()
    assert int(buf.count_nonzero()) == int(src[0].count_nonzero()) + int(src[2].count_nonzero())


def test_uint8_view_round_trip_like_the_offloader(acc: Accelerator) -> None:
    src = torch.randn(8192)
    raw = torch.empty(0, dtype=torch.uint8).set_(src.untyped_storage())
    host = acc.host_empty((raw.numel(),), torch.uint8)
    host.copy_(raw)
    back = torch.empty(raw.numel(), dtype=torch.uint8).copy_(host)
    assert torch.equal(back.view(torch.float32), src)


def test_no_files_left_behind(acc: Accelerator, monkeypatch: pytest.MonkeyPatch) -> None:
    # A private directory on the same tmpfs: other xdist workers' files never show in it, and the space check
    # reads the tmpfs (a directory on the disk would fall back to ordinary memory once the disk is 3/4 full).
    private = Path(tempfile.mkdtemp(prefix="test-host-tier-", dir=device_mod.SHM_DIR))
    try:
        monkeypatch.setattr(device_mod, "SHM_DIR", str(private))
        bufs = [acc.host_empty((n * 4096,), torch.uint8) for n in (1, 7, 256)]
        bufs += [acc.host_empty((8192,), torch.float32)]
        assert all(_is_shm(b) for b in bufs)
        assert list(private.iterdir()) == []
    finally:
        private.rmdir()


def _ordinary(acc: Accelerator, shape: tuple[int, ...]) -> torch.Tensor:
    buf = acc.host_empty(shape, torch.float32)
    assert not _is_shm(buf) and buf.shape == shape and buf.untyped_storage().resizable()
    return buf


def test_fallback_when_dir_missing_or_not_a_dir(
    acc: Accelerator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(device_mod, "SHM_DIR", str(tmp_path / "missing"))
    _ordinary(acc, (2, 8192))
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setattr(device_mod, "SHM_DIR", str(not_a_dir))
    anon, shmem = rss_anon_bytes(), rss_shmem_bytes()
    buf = _ordinary(acc, (16 * MB,)).fill_(1.0)  # 64 MB
    assert rss_anon_bytes() - anon > 56 * MB and rss_shmem_bytes() - shmem < 16 * MB
    del buf


def test_fallback_when_dir_full_leaves_no_file(acc: Accelerator, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    before = _our_shm_files()
    monkeypatch.setattr(device_mod.os, "posix_fallocate", full)
    _ordinary(acc, (4096,))
    assert _our_shm_files() == before


def test_fallback_keeps_a_reserve_free(acc: Accelerator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_mod, "SHM_RESERVE_FRACTION", 1.0)  # any buffer would eat into the reserve
    _ordinary(acc, (4096,))
    monkeypatch.setattr(device_mod, "SHM_RESERVE_FRACTION", 0.0)
    assert _is_shm(acc.host_empty((4096,), torch.float32))


@pytest.mark.parametrize("shape", [(0,), (3, 0), (1,), (1023,)])
def test_empty_and_small_buffers_are_ordinary(acc: Accelerator, shape: tuple[int, ...]) -> None:
    _ordinary(acc, shape)


def test_cpu_host_buffer_is_never_pinned(acc: Accelerator) -> None:
    buf = acc.host_empty((4, 4096), torch.float16, pinned=True)
    assert _is_shm(buf) and not buf.is_pinned()
