"""The NVMe tier: a mapped file holds the swap optimizer's states; its pages leave memory behind the step."""

import errno
import os
import threading

import pytest
import torch

from internlm_offload.device import Accelerator
from internlm_offload.device.disk_buffers import DiskBuffer, DiskSpaceError
from internlm_offload.optim import SwapAdamW

MiB = 2**20


def test_written_pages_leave_memory_and_come_back_with_their_bytes(tmp_path):
    disk = DiskBuffer(tmp_path, 8 * MiB)
    assert not list(tmp_path.iterdir())  # unlinked at once: nothing outlives the process
    data = torch.arange(2 * MiB, dtype=torch.int32)
    disk.tensor.view(torch.int32)[: data.numel()].copy_(data)
    assert disk.resident_bytes() >= data.numel() * 4
    disk.write_back(0, data.numel() * 4)
    disk.finish_writes()
    assert disk.resident_bytes() < MiB  # dropped from the mapping
    assert torch.equal(disk.tensor.view(torch.int32)[: data.numel()], data)  # faulted back from the file
    disk.release()


def test_a_missing_or_full_directory_is_one_line_naming_it(tmp_path, monkeypatch):
    with pytest.raises(DiskSpaceError, match="no_such_dir: cannot create a file there"):
        DiskBuffer(tmp_path / "no_such_dir", MiB)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(DiskSpaceError, match=r"cannot reserve 0\.00 GiB \(No space left on device\); .* GiB free"):
        DiskBuffer(tmp_path, MiB)
    assert not list(tmp_path.iterdir())


def adamw_pair(tmp_path):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(257, 33)) for _ in range(6)]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    swap = SwapAdamW(
        params, lr=1e-2, swap_optimizer_times=3, nvme_path=str(tmp_path), fused=True, accelerator=Accelerator("cpu")
    )
    return params, swap, copies, torch.optim.AdamW(copies, lr=1e-2, fused=True)


def test_swap_states_on_disk_step_bitwise_like_adamw_and_leave_memory(tmp_path):
    params, swap, copies, adamw = adamw_pair(tmp_path)
    for step in range(4):
        grads = [torch.randn_like(p) for p in params]
        for p, c, g in zip(params, copies, grads):
            p.grad, c.grad = g.clone(), g.clone()
        swap.step()
        adamw.step()
        swap.finish_copies()
    disk = swap._arena.disk
    disk.finish_writes()
    # written back behind the step: at most the last step's chunks in flight (the budget) stay resident
    assert disk.resident_bytes() <= swap._budget + 4096
    for p, c in zip(params, copies):
        assert torch.equal(p, c)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(swap.state[p][key], adamw.state[c][key])  # reading faults them back in
    loaded = SwapAdamW(params, lr=1e-2, nvme_path=str(tmp_path), fused=True, accelerator=Accelerator("cpu"))
    loaded.load_state_dict(swap.state_dict())  # a checkpoint's states go into the file
    assert all(torch.equal(loaded.state[p]["exp_avg"], swap.state[p]["exp_avg"]) for p in params)
    swap.close()
    loaded.close()
    assert not any(t.name.startswith("disk-write-back") for t in threading.enumerate())  # close stopped them
    assert torch.equal(swap.state[params[0]]["exp_avg"], adamw.state[copies[0]]["exp_avg"])  # still readable


def test_hybrid_cpu_states_on_disk_step_bitwise_like_adamw_and_leave_memory(tmp_path):
    from internlm_offload.optim import HybridDeviceOptimizer

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(257, 33)) for _ in range(6)]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    hybrid = HybridDeviceOptimizer(
        params, offload_fraction=1.0, lr=1e-2, nvme_path=str(tmp_path), accelerator=Accelerator("cpu")
    )
    adamw = torch.optim.AdamW(copies, lr=1e-2, fused=True)
    for _ in range(3):
        for p, c in zip(params, copies):
            p.grad = torch.randn_like(p)
            c.grad = p.grad.clone()
        hybrid.step()
        adamw.step()
    slabs = [unit.slab for unit in hybrid._cpu_units]
    for slab in slabs:
        slab.disk.finish_writes()
    assert sum(slab.disk.resident_bytes() for slab in slabs) <= 4096 * len(slabs)  # every piece written back
    assert hybrid.memory_stats()["disk_state_bytes"] == sum(p.numel() * 8 + 4 for p in params)  # + fp32 `step`
    assert all(torch.equal(p, c) for p, c in zip(params, copies))
    assert all(torch.equal(hybrid.state[p]["exp_avg_sq"], adamw.state[c]["exp_avg_sq"]) for p, c in zip(params, copies))
    hybrid.close()
