"""The data steps of a run: the step loader, the validation sets, the metrics log, the vocabulary check."""

from pathlib import Path
from typing import Any

from internlm_offload.builder.model import gradient_group, sequence_shard, uses_loss_parallel
from internlm_offload.config import ConfigError, RunConfig
from internlm_offload.data import StepLoader, StepSampler, Tokenizer
from internlm_offload.data.validation import find_validation_sets
from internlm_offload.engine.evaluation import Evaluator
from internlm_offload.engine.metrics import MetricsLog
from internlm_offload.engine.runtime import RunContext
from internlm_offload.log import get_logger
from internlm_offload.registry import DATASETS, build

logger = get_logger(__name__)


def check_vocab(model_vocab: int, tokenizer_vocab: int, tokenizer_name: str) -> None:
    if tokenizer_vocab > model_vocab:
        raise ConfigError(
            f"model.vocab_size={model_vocab} is smaller than the tokenizer's vocabulary ({tokenizer_vocab}, "
            f"data.tokenizer={tokenizer_name!r}); set model.vocab_size >= {tokenizer_vocab}"
        )


def build_metrics_log(cfg: RunConfig, work_dir: Path) -> MetricsLog:
    """metrics.jsonl, and TensorBoard beside it when `monitor.tensorboard`; a missing package is a config error."""
    try:
        return MetricsLog(work_dir / "metrics.jsonl", work_dir / "tensorboard" if cfg.monitor.tensorboard else None)
    except ImportError as exc:
        raise ConfigError(str(exc)) from None


def build_loader(cfg: RunConfig, ctx: RunContext, tokenizer: Tokenizer | None) -> StepLoader:
    data = cfg.data
    kwargs: dict[str, Any] = {"seq_len": data.seq_len}
    samples_per_micro_batch = data.micro_bsz
    if data.type in ("internevo", "chat"):
        kwargs.update(micro_bsz=data.micro_bsz, pack_sample_into_one=data.pack_sample_into_one)
        samples_per_micro_batch = 1  # a sample is one pack: the whole micro-batch
    if data.type == "internevo":
        kwargs.update(train_folder=data.train_folder, min_length=data.min_length)
    else:
        kwargs["tokenizer"] = tokenizer
    if data.type in ("text", "chat"):
        kwargs["paths"] = data.paths
    if data.type == "chat":
        kwargs.update(
            chat_template=data.chat_template,
            max_length=data.max_length,
            max_bad_fraction=data.max_bad_fraction,
            record_format=data.chat_format,
        )
    dataset = build(DATASETS, data.type, "data.type", **kwargs)
    sampler = StepSampler(
        len(dataset),
        micro_bsz=samples_per_micro_batch,
        micro_num=data.micro_num,
        rank=ctx.dp_rank,  # a tensor group's ranks read the same micro-batches
        world_size=ctx.dp_size,
        seed=data.seed,
        shuffle=data.shuffle,
    )
    return StepLoader(dataset, sampler)


def build_evaluator(cfg: RunConfig, ctx: RunContext) -> Evaluator | None:
    data = cfg.data
    if data.valid_folder is None:
        return None
    sets = find_validation_sets(data.valid_folder, seq_len=data.seq_len, min_length=data.min_length)
    evaluator = Evaluator(
        sets,
        rank=ctx.dp_rank,
        world_size=ctx.dp_size,
        micro_bsz=data.micro_bsz,
        valid_micro_num=data.valid_micro_num,
        device=ctx.device,
        distributed=ctx.distributed,
        loss_parallel=uses_loss_parallel(cfg),
        group=gradient_group(cfg, ctx),
        sequence_shard=sequence_shard(cfg, ctx),
    )
    for name in evaluator.empty_sets:
        logger.warning("validation set %r has fewer documents than data-parallel ranks; skipped", name)
    return evaluator
