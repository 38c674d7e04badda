"""The project's logger: one `internlm_offload` logger, configured once by the entry point."""

import logging
import sys

ROOT_LOGGER_NAME = "internlm_offload"


def get_logger(name: str) -> logging.Logger:
    """Return a child of the project logger (`internlm_offload.<name>`)."""
    if name.startswith(ROOT_LOGGER_NAME):
        return logging.getLogger(name)
    return logging.getLogger(f"{ROOT_LOGGER_NAME}.{name}")


def setup_logging(rank: int = 0, level: int = logging.INFO) -> None:
    """Log INFO on rank 0 and WARNING elsewhere, to stderr, with a rank prefix."""
    root = logging.getLogger(ROOT_LOGGER_NAME)
    root.handlers.clear()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level if rank == 0 else logging.WARNING)
    root.propagate = False
