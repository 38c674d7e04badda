"""Documents packed in one row on the DeepSeek-V3 family (configs/deepseek_v3_tiny.py: MLA, a dense first block, sparse
blocks of the bias router; and GLM-4.5's grouped-query attention): with `position_ids` restarting at each document,
each document's loss is the one it gets run alone (tests/unit/test_mla.py holds the attention block to transformers';
this is the whole model: rope at each document's own positions, the document mask through every block, the router
choosing per token)."""

import pytest
import torch
from test_deepseek_tensor_plan import GLM45, TINY

from internlm_offload.builder.model import build_model
from internlm_offload.config import ModelConfig
from internlm_offload.engine.loss import token_loss_sum

DOCUMENTS = [[5, 9, 3, 7, 1, 44, 2, 8, 17], [8, 2, 6, 250, 31, 12, 90]]
# Another row shape than a document's own: the matmuls sum in another order (tests/README.md); measured at most
# 2.4e-7 relative (fp32, seed 0)
RTOL = 1e-5


def randomized(model: torch.nn.Module) -> torch.nn.Module:
    """Weights far from the init's near-uniform output (norms around 1), so that a token seeing another document's
    shows in its loss."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model


def document_loss(logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """The mean next-token loss of one document's logits (T, V): its last token predicts nothing."""
    return token_loss_sum(logits[:-1], torch.tensor(tokens[1:])) / (len(tokens) - 1)


@pytest.mark.parametrize("config", [TINY, GLM45], ids=["mla", "glm45-gqa"])
def test_each_document_of_a_packed_row_has_the_loss_it_has_alone(config):
    torch.manual_seed(0)
    model = randomized(build_model(ModelConfig(type="deepseek_v3", hf_config=config), torch.device("cpu")).eval())
    row = torch.tensor([t for d in DOCUMENTS for t in d])[None]
    positions = torch.cat([torch.arange(len(d)) for d in DOCUMENTS])[None]
    starts = [0, len(DOCUMENTS[0]), row.shape[1]]
    with torch.no_grad():
        packed = model(row, positions).logits[0]
        unmasked = model(row).logits[0]
        for k, tokens in enumerate(DOCUMENTS):
            alone = document_loss(model(torch.tensor(tokens)[None]).logits[0], tokens)
            in_row = document_loss(packed[starts[k] : starts[k + 1]], tokens)
            torch.testing.assert_close(in_row, alone, rtol=RTOL, atol=0)
    # the mask and the restarted positions matter: read as one document, the second's loss is another
    second_as_continued = document_loss(unmasked[starts[1] :], DOCUMENTS[1])
    assert not torch.allclose(second_as_continued, alone, rtol=1e-2, atol=0), (second_as_continued, alone)
