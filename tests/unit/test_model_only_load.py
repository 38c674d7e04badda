"""`CheckpointManager.load_model`: weights only, exactly, into a model of another dtype layout."""

import torch

from internlm_offload.device import Accelerator
from internlm_offload.engine.checkpoint import CheckpointManager
from internlm_offload.engine.precision import MasterWeights
from internlm_offload.engine.runtime import RunContext
from internlm_offload.model import InternLM2


def model(seed: int) -> InternLM2:
    torch.manual_seed(seed)
    return InternLM2(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_attention_heads=2, vocab_size=259)


def test_weights_load_exactly_and_leave_the_optimizer_alone(tmp_path):
    ctx = RunContext(rank=0, local_rank=0, world_size=1, accelerator=Accelerator("cpu"))
    source = model(seed=1)
    optimizer = torch.optim.AdamW(source.parameters(), lr=1e-3)
    source(torch.randint(0, 259, (2, 8))).logits.sum().backward()
    optimizer.step()
    manager = CheckpointManager(tmp_path / "ckpt", ctx)
    manager.save(1, model=source, optimizer=optimizer, train_state={"step": 1})

    target = model(seed=2)  # other weights; loaded as fp32 masters of a bf16 model
    masters = MasterWeights(target, torch.bfloat16)
    fresh = torch.optim.AdamW(masters.module.parameters(), lr=1e-3)
    loaded = manager.load_model(tmp_path / "ckpt", model=masters.module)
    masters.copy_to_model()
    assert loaded.name == "step_00000001"
    for (name, want), got in zip(source.named_parameters(), masters.module.parameters()):
        assert torch.equal(got, want), name
    assert all(p.dtype == torch.bfloat16 for p in target.parameters())
    assert torch.equal(target.output.weight, source.output.weight.detach().to(torch.bfloat16))
    assert not fresh.state  # no optimizer state came along
