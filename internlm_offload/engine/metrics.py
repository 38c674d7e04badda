"""Per-step metrics: `metrics.jsonl` (rank 0), a progress bar or log lines, memory readings."""

import json
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from internlm_offload.device.cpu_memory import host_rss_bytes
from internlm_offload.device import Accelerator
from internlm_offload.log import get_logger

logger = get_logger(__name__)


class MetricsLog:
    """Appends one JSON object per step to `metrics.jsonl`; floats keep full `repr` precision. With
    `tensorboard_dir`, every number of a record also goes to TensorBoard under the same name."""

    def __init__(self, path: Path, tensorboard_dir: Path | None = None) -> None:
        self.path = path
        self.tensorboard = TensorBoardScalars(tensorboard_dir) if tensorboard_dir is not None else None

    def truncate_after(self, step: int) -> None:
        """Drop records past `step` (a resumed run rewrites them), keeping the file's earlier lines."""
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            self.tensorboard.write(record)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()


class TensorBoardScalars:
    """A TensorBoard run in `log_dir`: each numeric field of a record is a scalar at the record's step.

    The writer opens at the first record with `purge_step` at its step, so a resumed run replaces the
    events an earlier attempt wrote past its checkpoint, as `MetricsLog.truncate_after` does for the jsonl."""

    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(
                f"monitor.tensorboard=True needs the tensorboard package: pip install 'internlm_offload[tb]' ({exc})"
            ) from None
        self._writer_class = SummaryWriter
        self.log_dir = log_dir
        self.writer: Any = None

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        if self.writer is None:
            self.writer = self._writer_class(log_dir=str(self.log_dir), purge_step=step)
        for name, value in record.items():
            if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def memory_record(accelerator: Accelerator) -> dict[str, int]:
    """Device memory now and peak (cpu: RSS and peak RSS) plus host RSS, in bytes."""
    return {
        "device_mem_bytes": accelerator.memory_allocated(),
        "device_peak_mem_bytes": accelerator.max_memory_allocated(),
        "host_rss_bytes": host_rss_bytes(),
    }


class Progress:
    """A tqdm bar with loss and throughput on a TTY; plain log lines every `log_every` steps otherwise."""

    def __init__(self, *, total: int, initial: int, enabled: bool, mode: str = "auto", log_every: int = 1) -> None:
        use_bar = mode == "on" or (mode == "auto" and sys.stderr.isatty())
        self.enabled = enabled
        self.log_every = log_every
        self.total = total
        self.bar = tqdm(total=total, initial=initial, dynamic_ncols=True) if enabled and use_bar else None

    def update(self, step: int, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
            self.bar.update(1)
        elif step % self.log_every == 0 or step == self.total:
            logger.info(
                "step=%d/%d loss=%.6f grad_norm=%.4f lr=%.3e tokens/s=%.0f step_time=%.3fs",
                step,
                self.total,
                record["loss"],
                record["grad_norm"],
                record["lr"],
                record["tokens_per_s"],
                record["step_time_s"],
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
