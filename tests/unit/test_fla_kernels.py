"""The flash-linear-attention adapter (model/fla_kernels.py) on cpu: fla itself runs only on cuda, so a stand-in
keeping fla's calling contract (one flattened row, `cu_seqlens` at document starts, q and k L2-normalised in the
kernel, q scaled by dk^-1/2) runs the token-by-token recurrence per document; the layer through the adapter must
then give the torch chunked path's output and gradients. The real kernels are checked against the torch path by
scripts/gpu_check_fla.sh where a GPU is lent."""

import sys
import types

import pytest
import torch

import internlm_offload.model.fla_kernels as fla_kernels
from internlm_offload.model.attention import Documents
from internlm_offload.model.gated_deltanet import l2norm
from tests.unit.test_gated_deltanet import make, recurrent_rule

CALLS: list[dict] = []


def stand_in_kernel(q, k, v, *, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    """fla's chunk_gated_delta_rule contract: (1, N, H, d) inputs, the state zero at each cu_seqlens entry."""
    CALLS.append({"shape": tuple(q.shape), "cu_seqlens": cu_seqlens.tolist(), "dtype": cu_seqlens.dtype})
    assert q.shape[0] == 1 and initial_state is None and not output_final_state and use_qk_l2norm_in_kernel
    q = l2norm(q) * q.shape[-1] ** -0.5
    k = l2norm(k)
    bounds = cu_seqlens.tolist()
    outs = [
        recurrent_rule(*(t[0, a:b].transpose(0, 1) for t in (q, k, v, g, beta))).transpose(0, 1)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return torch.cat(outs).unsqueeze(0), None


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """fla importable (the stand-in) and every tensor 'on the accelerator'."""
    gated = types.ModuleType("fla.ops.gated_delta_rule")
    gated.chunk_gated_delta_rule = stand_in_kernel
    for name, module in {"fla": types.ModuleType("fla"), "fla.ops": types.ModuleType("fla.ops")}.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", gated)
    monkeypatch.setattr(fla_kernels, "on_accelerator", lambda x: True)
    CALLS.clear()


def test_document_starts_of_packed_rows():
    position_ids = torch.tensor([[0, 1, 2, 0, 1], [3, 4, 0, 1, 2]])  # the second row continues a document
    assert fla_kernels.document_starts(position_ids).tolist() == [0, 3, 5, 7, 10]
    assert fla_kernels.document_starts(position_ids).dtype == torch.int32


@pytest.mark.parametrize("fused", [True, False])
def test_the_kernel_path_equals_the_torch_path_on_packed_rows(stand_in: None, fused: bool):
    """Two rows, the first packing documents of 5 and 11 tokens, float64: output and every gradient within 1e-10."""
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, *range(11)], list(range(3, 19))])  # row 2 goes on a document
    documents = Documents(position_ids)
    results = []
    for impl in ("sdpa", "auto"):
        layer = make(fused=fused, chunk_size=4).double()
        layer.attn_impl = impl
        out = layer(x, documents=documents)
        out.square().sum().backward()
        results.append((out, {n: p.grad for n, p in layer.named_parameters()}))
    assert [c["cu_seqlens"] for c in CALLS] == [[0, 5, 16, 32]]
    assert CALLS[0]["shape"] == (1, 32, 4, 8)  # the key heads repeated to the value heads
    (ref, ref_grads), (out, grads) = results
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-10, msg=name)


def test_sdpa_and_cpu_tensors_keep_the_torch_path(stand_in: None, monkeypatch: pytest.MonkeyPatch):
    x = torch.randn(1, 8, 32)
    assert fla_kernels.fla_delta_rule("sdpa", x) is None
    assert fla_kernels.fla_delta_rule("auto", x) is stand_in_kernel
    monkeypatch.setattr(fla_kernels, "on_accelerator", lambda x: x.is_cuda)
    assert fla_kernels.fla_delta_rule("auto", x) is None
    make()(x)
    assert CALLS == []


def test_without_fla_the_torch_path(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "fla", None)  # import fails
    monkeypatch.setattr(fla_kernels, "on_accelerator", lambda x: True)
    assert fla_kernels.fla_delta_rule("auto", torch.zeros(1)) is None


def test_the_bench_stops_in_one_line_without_cuda():
    from internlm_offload.bench.fla_kernels import main

    with pytest.raises(SystemExit, match="needs cuda and flash-linear-attention"):
        main(["--quick", "--device", "cpu"])
