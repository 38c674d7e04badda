"""transformers' step-1 loss and grad norm from a folder alone: the check the family folder tests share (import as
`from folder_parity import ...`; tests/ is on the path)."""

import torch
import torch.nn.functional as F


def grad_norm(model: torch.nn.Module) -> torch.Tensor:
    """The 2-norm of every gradient the last backward left (parameters without one, frozen ones, do not count)."""
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))


def next_token_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The mean cross entropy of each token's logits against the next token (transformers' `labels=ids` loss)."""
    return F.cross_entropy(model(ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def step_1_ids(vocab: int, seq: int) -> torch.Tensor:
    """Two seeded rows of `seq` token ids below `vocab`."""
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1))


def assert_step_1_matches(native: torch.nn.Module, reference: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """On `ids`, `native`'s loss and grad norm are transformers' `reference`'s within 1e-5 (fp32): the native loss,
    for the checks a family adds."""
    want = reference(ids, labels=ids).loss
    got = next_token_loss(native, ids)
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad_norm(native), grad_norm(reference), rtol=0, atol=1e-5)
    return got
