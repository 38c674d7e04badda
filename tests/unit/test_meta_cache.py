"""The memoised meta kernels change no figure of a trace (planner/meta_cache.py) and are used."""

import pytest
import torch

from internlm_offload.config import load_config_file, resolve_config
from internlm_offload.planner import meta_cache, trace
from internlm_offload.planner.meta_cache import MetaKernelCache, memoisable

CASES = {
    "dense": ("configs/internlm2_tiny.py", {}, 1),
    "fsdp2 x2 + offload + ckpt": (
        "configs/internlm2_tiny.py",
        {"parallel.mode": "fsdp2", "model.checkpoint": 0.5, "cpu_offloading.enable": True},
        2,
    ),
    "moe + swap": ("configs/internlm2_tiny_moe.py", {"swap_optimizer": True}, 1),
    "pipeline 2 x 1F1B + offload": ("configs/internlm2_tiny_pp2.py", {"cpu_offloading.enable": True}, 2),
}


@pytest.mark.parametrize("case", CASES)
def test_a_memoised_trace_gives_every_figure_of_the_plain_one(monkeypatch, case):
    path, options, world_size = CASES[case]
    cfg = resolve_config(load_config_file(path, options), world_size=world_size)
    monkeypatch.setattr(trace, "MEMOISE_KERNELS", False)
    plain = trace.trace_step(cfg, world_size)
    monkeypatch.setattr(trace, "MEMOISE_KERNELS", True)
    monkeypatch.setattr(meta_cache, "_RECORDED", {})
    hits = []
    init = MetaKernelCache.__init__

    def counted_init(self):
        init(self)
        hits.append(self)

    monkeypatch.setattr(MetaKernelCache, "__init__", counted_init)
    memoised = trace.trace_step(cfg, world_size)
    assert vars(memoised) == vars(plain)
    assert hits and hits[0].hits > 10 * hits[0].misses  # most ops answered from the record


def test_views_in_place_ops_and_collectives_are_never_memoised():
    aten = torch.ops.aten
    assert memoisable(aten.mm.default) and memoisable(aten.native_layer_norm.default)
    assert not memoisable(aten.view.default)  # an alias of its input
    assert not memoisable(aten.add_.Tensor)  # mutates its input
    assert not memoisable(aten.nonzero.default)  # its shape depends on the values
    assert not memoisable(torch.ops._c10d_functional.all_reduce.default)  # not aten: a collective


def test_an_op_returning_its_input_storage_is_run_every_time(monkeypatch):
    """`_unsafe_view` declares no alias but returns a view: a fresh tensor would count its bytes twice."""
    monkeypatch.setattr(meta_cache, "_RECORDED", {})
    x = torch.empty(4, 6, device="meta")
    with MetaKernelCache() as cache:
        first = torch.ops.aten._unsafe_view.default(x, [24])
        second = torch.ops.aten._unsafe_view.default(x, [24])
        y = torch.mm(x, x.t())
        z = torch.mm(x, x.t())
    assert first.untyped_storage()._cdata == second.untyped_storage()._cdata == x.untyped_storage()._cdata
    assert cache.hits == 1 and y.shape == z.shape == (4, 4) and y.stride() == z.stride()
