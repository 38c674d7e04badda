"""The bias router's balancing losses (model/balancing.py) against hand computations: XTuner's over this rank's
micro-batch and over the global batch (a pool of the statistics of every rank), and DeepSeek-V3's sequence-wise one;
the family model returning it as `moe_aux` in training only; the config keys that turn it on."""

import math
from pathlib import Path

import pytest
import torch

from internlm_offload.config import ConfigError, load_config_file, resolve_config
from internlm_offload.model.balancing import balancing_loss, row_counts
from internlm_offload.model.output import MOE_AUX
from internlm_offload.model.router import BiasRouter

E, K, ROWS, S, H = 8, 2, 2, 5, 6


def router(n_group: int = 1, topk_group: int = 1, seed: int = 0) -> BiasRouter:
    """A bias router with random weights and a random bias (some experts pushed up, some down)."""
    gen = torch.Generator().manual_seed(seed)
    r = BiasRouter(H, E, K, normalize_weights=True, scaling_factor=2.5, n_group=n_group, topk_group=topk_group)
    with torch.no_grad():
        r.weight.copy_(torch.randn(E, H, generator=gen))
        r.e_score_correction_bias.copy_(0.1 * torch.randn(E, generator=gen))
    return r


def tokens(seed: int = 1, rows: int = ROWS) -> torch.Tensor:
    return torch.randn(rows * S, H, generator=torch.Generator().manual_seed(seed))


def stats_of(r: BiasRouter, x: torch.Tensor, rows: int = ROWS):
    return r.stats(r(x), rows=rows)


def chosen(r: BiasRouter, x: torch.Tensor) -> list[list[int]]:
    return r(x).indices.tolist()


def hand_router_weights(r: BiasRouter, x: torch.Tensor) -> list[list[float]]:
    """XTuner's router weights by hand: sigmoid + bias, groups outside the best topk_group (by the sum of their 2 best
    biased scores) set to 0, normalised per token."""
    out = []
    for t in range(x.shape[0]):
        biased = [
            1 / (1 + math.exp(-float(r.weight[e].detach() @ x[t]))) + float(r.e_score_correction_bias[e])
            for e in range(E)
        ]
        size = E // r.n_group
        group_score = [sum(sorted(biased[g * size : (g + 1) * size])[-2:]) for g in range(r.n_group)]
        kept = sorted(range(r.n_group), key=lambda g: -group_score[g])[: r.topk_group]
        row = [b if e // size in kept else 0.0 for e, b in enumerate(biased)]
        out.append([v / sum(row) for v in row])
    return out


def hand_xtuner_loss(counts: list[float], weight_sums: list[float], tokens: int) -> float:
    """E / (T k) * sum_e c_e * (sum_t w_{t,e} / T), one layer."""
    return E / (tokens * K) * sum(c * w / tokens for c, w in zip(counts, weight_sums, strict=True))


def hand_counts(ids: list[list[int]]) -> list[float]:
    return [float(sum(row.count(e) for row in ids)) for e in range(E)]


@pytest.mark.parametrize("groups", [(1, 1), (4, 2)], ids=["one group", "2 of 4 groups"])
def test_micro_batch_loss_is_xtuners_by_hand(groups):
    """Two layers, summed: each E / (T k) * sum_e (choices of e) * (mean router weight of e); with groups the
    weights of the left-out groups count 0 (XTuner masks with 0)."""
    routers, xs = [router(*groups, seed=0), router(*groups, seed=5)], [tokens(1), tokens(2)]
    want = 0.0
    for r, x in zip(routers, xs, strict=True):
        weights = hand_router_weights(r, x)
        sums = [sum(w[e] for w in weights) for e in range(E)]
        want += hand_xtuner_loss(hand_counts(chosen(r, x)), sums, x.shape[0])
    got = balancing_loss("micro_batch", [stats_of(r, x) for r, x in zip(routers, xs, strict=True)], E, K)
    assert got.item() == pytest.approx(want, rel=1e-6)


def test_sequence_loss_is_deepseeks_by_hand():
    """Per row (sequence) of S tokens: sum_e f_e P_e, f_e = E / (k S) * (choices of e in the row), P_e the row's mean
    of the unbiased scores normalised over all experts; the rows' mean, the layers' sum."""
    routers, xs = [router(4, 2, seed=0), router(seed=3)], [tokens(1), tokens(4)]
    want = 0.0
    for r, x in zip(routers, xs, strict=True):
        ids = chosen(r, x)
        per_row = []
        for row in range(ROWS):
            span = range(row * S, (row + 1) * S)
            scores = [[1 / (1 + math.exp(-float(r.weight[e].detach() @ x[t]))) for e in range(E)] for t in span]
            shares = [[s / sum(token) for s in token] for token in scores]
            f = [E / (K * S) * sum(ids[t].count(e) for t in span) for e in range(E)]
            p = [sum(sh[e] for sh in shares) / S for e in range(E)]
            per_row.append(sum(fe * pe for fe, pe in zip(f, p, strict=True)))
        want += sum(per_row) / ROWS
    got = balancing_loss("sequence", [stats_of(r, x) for r, x in zip(routers, xs, strict=True)], E, K)
    assert got.item() == pytest.approx(want, rel=1e-6)


def test_the_counts_are_the_routers_biased_choices_not_the_unbiased_top_k():
    """A bias large enough to change the choice: the loss counts the experts the tokens go to."""
    r = router()
    with torch.no_grad():
        r.e_score_correction_bias.zero_()
        r.e_score_correction_bias[E - 1] = 10.0  # every token's first choice
    x = tokens()
    st = stats_of(r, x)
    assert st.topk_counts[E - 1] == x.shape[0]
    sums = [sum(w[e] for w in hand_router_weights(r, x)) for e in range(E)]
    want = hand_xtuner_loss(hand_counts(chosen(r, x)), sums, x.shape[0])
    assert balancing_loss("micro_batch", [st], E, K).item() == pytest.approx(want, rel=1e-6)


class TwoRanks:
    """A pool of two ranks in one process: this rank's statistics plus the other's (fixed), the gradient of the sums
    returned as an all-reduce's backward returns it (every rank's identical gradient, summed: times 2)."""

    def __init__(self, other_counts: torch.Tensor, other_sums: torch.Tensor) -> None:
        self.other_counts, self.other_sums = other_counts, other_sums

    def __call__(self, counts, sums):
        return counts + self.other_counts, _TimesTwoBackward.apply(sums) + self.other_sums.detach()


class _TimesTwoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


def test_global_batch_loss_pools_every_ranks_counts_and_weights():
    """Rank 0 holds rows 0-1, rank 1 rows 2-3 of one batch: with the pool the loss is the whole batch's (as one
    process computes it over all four rows), and the two ranks' gradients averaged (DDP) are the whole batch's. Without
    the pool it is rank 0's micro-batch loss, another number."""
    r = router(4, 2)
    whole = tokens(rows=4)
    want_loss = balancing_loss("global_batch", [stats_of(r, whole, rows=4)], E, K)
    (want_grad,) = torch.autograd.grad(want_loss, r.weight)
    halves = whole[: 2 * S], whole[2 * S :]
    grads, losses = [], []
    for mine, theirs in (halves, halves[::-1]):
        other = stats_of(r, theirs)
        pool = TwoRanks(other.topk_counts[None], other.choice_shares().sum(0)[None])
        loss = balancing_loss("global_batch", [stats_of(r, mine)], E, K, pool)
        losses.append(loss)
        grads.append(torch.autograd.grad(loss, r.weight)[0])
    for loss in losses:
        assert loss.item() == pytest.approx(want_loss.item(), rel=1e-6)
    torch.testing.assert_close((grads[0] + grads[1]) / 2, want_grad, rtol=1e-5, atol=1e-7)
    local = balancing_loss("global_batch", [stats_of(r, halves[0])], E, K)  # no pool: this process's batch
    assert local.item() == pytest.approx(balancing_loss("micro_batch", [stats_of(r, halves[0])], E, K).item())
    assert abs(local.item() - want_loss.item()) > 1e-4


def test_row_counts_count_each_row_apart():
    ids = torch.tensor([[0, 1, 1, 3], [2, 2, 2, 0]])
    assert row_counts(ids, 4).tolist() == [[1, 2, 0, 1], [1, 0, 3, 0]]


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="'global'"):
        balancing_loss("global", [stats_of(router(), tokens())], E, K)


# ----------------------------------------------------------------------------- the family and the config

REPO = Path(__file__).resolve().parents[2]
DEEPSEEK = REPO / "configs" / "deepseek_v3_tiny.py"


def load(config: Path = DEEPSEEK, world_size: int = 1, **options: object):
    return resolve_config(load_config_file(config, options), world_size)


def test_the_family_model_returns_the_loss_in_training_only():
    from internlm_offload.builder.model import aux_loss_coefficients, build_model

    cfg = load(**{"model.balancing_loss": "global_batch", "loss.moe_loss_coeff": 0.001})
    torch.manual_seed(0)
    model = build_model(cfg.model, torch.device("cpu"))
    assert aux_loss_coefficients(cfg, model) == {MOE_AUX: 0.001}
    ids = torch.randint(0, 259, (2, 16))
    out = model(ids)
    assert set(out.aux_losses) == {MOE_AUX} and out.aux_losses[MOE_AUX].requires_grad
    # three sparse blocks, each about 1 for a router near balance at init
    assert 2.0 < out.aux_losses[MOE_AUX].item() < 4.5
    model.eval()
    assert model(ids).aux_losses == {}
    plain = load()
    assert aux_loss_coefficients(plain, build_model(plain.model, torch.device("cpu"))) == {}


SEQUENCE = {"model.balancing_loss": "sequence", "loss.moe_loss_coeff": 1e-4}


@pytest.mark.parametrize(
    ("options", "world_size", "message"),
    [
        ({"model.balancing_loss": "global_batch"}, 1, "loss.moe_loss_coeff, which is not set"),
        ({**SEQUENCE, "parallel.tensor.size": 2, "parallel.mode": "fsdp2"}, 2, "routes chunks"),
        ({**SEQUENCE, "model.balancing_loss": "sequential"}, 1, "balancing_loss"),
    ],
    ids=["coefficient unset", "sequence under tensor parallel", "unknown kind"],
)
def test_the_config_refuses(options, world_size, message):
    with pytest.raises(ConfigError, match=message):
        load(world_size=world_size, **options)


def test_another_family_refuses_the_key():
    with pytest.raises(ConfigError, match="model.type='deepseek_v3'"):
        load(REPO / "configs" / "internlm2_tiny.py", **{**SEQUENCE, "model.balancing_loss": "micro_batch"})


# ----------------------------------------------------------------------------- what the bias counts


def test_a_training_pack_has_no_pad_and_its_unlabelled_tokens_count(tmp_path):
    """The router bias's load is the choices of real tokens. This trainer's packs hold no padding: InternEvo's packing
    cuts one stream of documents every seq_len * micro_bsz tokens (a document cut at a pack's end goes on in the
    next), so every slot is a document's token, whatever its label. Prompt tokens (labels -100) are real: the sparse
    blocks count every token of the pack, as a hand count of the routers' choices over all 64 says. Padding exists
    only in validation samples, whose forwards count nothing (test_bias_router.py)."""
    from internlm_offload.builder.model import build_model
    from internlm_offload.data import build_internevo_dataset
    from internlm_offload.data.tokenized import IGNORE_INDEX, write_bin_file
    from internlm_offload.model.moe import BiasBlocks, MoE

    prompt, reply = [-(i % 50) - 1 for i in range(8)], list(range(60, 68))
    write_bin_file(tmp_path / "a.bin", [prompt + reply] * 12)  # half of every document unlabelled
    packs = build_internevo_dataset(
        seq_len=32, micro_bsz=2, train_folder=str(tmp_path), pack_sample_into_one=False, min_length=0
    )
    input_ids, labels, positions = packs[0]
    assert input_ids.numel() == 64 and (labels == IGNORE_INDEX).sum() >= 28  # every slot a token; many unlabelled
    torch.manual_seed(0)
    model = build_model(load().model, torch.device("cpu")).train()
    choices = []
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        moe.router.register_forward_hook(lambda mod, args, out: choices.append(out.indices))
    model(input_ids, positions)
    counted = BiasBlocks(model).take()
    hand = torch.stack([torch.bincount(ids.flatten(), minlength=counted.shape[1]).float() for ids in choices])
    assert torch.equal(counted, hand) and (counted.sum(-1) == 64 * 2).all()
