"""Unit tests for `HostArena`: many tensors as 512-byte-aligned, non-overlapping views of one host buffer."""

import math
from collections.abc import Iterator

import pytest
import torch

import internlm_offload.device.host_alloc as device_mod
from internlm_offload.device import Accelerator
from internlm_offload.device.host_buffers import ALIGNMENT, HostArena

SPECS = [
    ((1023,), torch.float32),
    ((), torch.float32),  # a 0-dim scalar, as AdamW's `step`
    ((7, 3), torch.bfloat16),
    ((5,), torch.int64),
    ((0,), torch.float32),  # empty: takes no bytes
    ((3,), torch.uint8),
    ((4, 4, 2), torch.float64),
    ((2,), torch.bool),
    ((4097,), torch.float16),
    ((1,), torch.complex64),
]


@pytest.fixture
def acc() -> Iterator[Accelerator]:
    accelerator = Accelerator("cpu")
    yield accelerator
    accelerator.close_streams()


def _nbytes(shape: tuple, dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _fill(t: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if t.dtype == torch.bool:
        values = torch.randint(0, 2, t.shape, generator=gen).bool()
    elif t.dtype.is_floating_point or t.dtype.is_complex:
        values = torch.randn(t.shape, generator=gen, dtype=t.dtype)
    else:
        values = torch.randint(0, 100, t.shape, generator=gen).to(t.dtype)
    t.copy_(values)
    return values


def test_views_have_specs_shapes_and_dtypes(acc: Accelerator) -> None:
    arena = HostArena(acc, SPECS, pinned=False)
    for i, (shape, dtype) in enumerate(SPECS):
        view = arena.view(i)
        assert view.shape == torch.Size(shape) and view.dtype == dtype, i
        assert view.device.type == "cpu" and view.is_contiguous()
        assert view.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr()


def test_offsets_and_size_are_aligned_and_disjoint(acc: Accelerator) -> None:
    arena = HostArena(acc, SPECS, pinned=False)
    assert all(off % ALIGNMENT == 0 for off in arena.offsets)
    assert arena.nbytes % ALIGNMENT == 0
    assert arena.buffer.numel() == arena.nbytes and arena.buffer.dtype == torch.uint8
    base = arena.buffer.data_ptr()
    ranges = []
    for i, (shape, dtype) in enumerate(SPECS):
        view = arena.view(i)
        start = view.storage_offset() * view.element_size()  # data_ptr() of an empty tensor is 0
        assert start == arena.offsets[i]
        if view.numel():
            assert view.data_ptr() - base == start
        assert 0 <= start and start + _nbytes(shape, dtype) <= arena.nbytes, i
        ranges.append((start, start + _nbytes(shape, dtype)))
    nonempty = sorted(r for r in ranges if r[1] > r[0])
    assert all(end <= nxt for (_, end), (nxt, _) in zip(nonempty, nonempty[1:])), "views overlap"
    # Only alignment padding between consecutive views: the arena is not wasteful.
    assert arena.nbytes < sum(_nbytes(s, d) for s, d in SPECS) + ALIGNMENT * len(SPECS)


def test_views_are_aligned_in_memory_large_arena(acc: Accelerator) -> None:
    arena = HostArena(acc, SPECS, pinned=False)
    assert arena.nbytes >= device_mod.SHM_MIN_BYTES  # a shared-memory mapping: page aligned
    assert all(arena.view(i).data_ptr() % ALIGNMENT == 0 for i in range(len(SPECS)) if arena.view(i).numel())


@pytest.mark.parametrize("where", ["small_arena", "no_shm_dir"])
def test_views_are_aligned_in_memory_without_shm_mapping(
    acc: Accelerator, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if where == "small_arena":
        specs = [((3,), torch.float32), ((5,), torch.float64)]  # 1 KiB: under SHM_MIN_BYTES
    else:
        monkeypatch.setattr(device_mod, "SHM_DIR", "/nonexistent-internlm-offload-dir")
        specs = SPECS
    misaligned = 0
    keep = []
    for _ in range(8):  # malloc may hand out a 512-aligned block by chance; eight in a row it does not
        arena = HostArena(acc, specs, pinned=False)
        keep.append(arena)
        misaligned += any(arena.view(i).data_ptr() % ALIGNMENT for i in range(len(specs)) if arena.view(i).numel())
    assert misaligned == 0


def test_writes_round_trip_without_clobbering(acc: Accelerator) -> None:
    arena = HostArena(acc, SPECS, pinned=False)
    expected = [_fill(arena.view(i), seed=i) for i in range(len(SPECS))]  # all written before any read
    for i, values in enumerate(expected):
        assert torch.equal(arena.view(i), values), i
    # A write through one view changes its slot only.
    arena.view(0).fill_(7.0)
    assert torch.equal(arena.view(0), torch.full((1023,), 7.0))
    for i, values in enumerate(expected[1:], start=1):
        assert torch.equal(arena.view(i), values), i
    # Views are views: a write through one view object is seen by a fresh view of the same slot.
    first = arena.view(3)
    first.add_(1)
    assert torch.equal(arena.view(3), expected[3] + 1)


def test_empty_spec_list(acc: Accelerator) -> None:
    arena = HostArena(acc, [], pinned=False)
    assert arena.nbytes == 0 and arena.offsets == []


def test_release_makes_view_raise_and_old_views_stay_valid(acc: Accelerator) -> None:
    arena = HostArena(acc, SPECS, pinned=False)
    kept = arena.view(0)
    values = _fill(kept, seed=0)
    arena.release()
    assert arena.buffer is None
    with pytest.raises(RuntimeError, match="release"):
        arena.view(0)
    with pytest.raises(RuntimeError, match="release"):
        arena.view(len(SPECS) - 1)
    assert torch.equal(kept, values)  # its memory is still alive through the view
    arena.release()  # idempotent


def test_uses_the_accelerators_host_tier(acc: Accelerator, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = Accelerator.host_empty

    def counting(self: Accelerator, shape: tuple, dtype: torch.dtype, pinned: bool = True) -> torch.Tensor:
        calls.append((tuple(shape), dtype, pinned))
        return original(self, shape, dtype, pinned=pinned)

    monkeypatch.setattr(Accelerator, "host_empty", counting)
    arena = HostArena(acc, SPECS, pinned=True)
    assert len(calls) == 1, calls  # one allocation for every tensor
    ((shape, dtype, pinned),) = calls
    assert dtype == torch.uint8 and pinned is True and len(shape) == 1 and shape[0] >= arena.nbytes
    assert arena.buffer.untyped_storage().filename is not None  # cpu host tier: a shared-memory mapping
