"""Config → a ready `Trainer`: the one place that reads the config and wires a run together.

run.py states the order once (`build_components`: model → tensor parallel → precision → layer plan → data-parallel
wrapping → optimizer → gradient offload → schedule) and makes the Trainer (`make_trainer`); model.py, optimizer.py and
data.py hold the steps, each with plain arguments for the layers below. The memory features are applied to the bare
model before data-parallel wrapping, so FSDP2 shards the same blocks the plan acted on.
"""

from internlm_offload.builder.data import build_loader
from internlm_offload.builder.model import build_layer_plan, build_model, offload_settings
from internlm_offload.builder.optimizer import build_optimizer
from internlm_offload.builder.run import Components, build_components, build_trainer, make_trainer, trainer_settings

__all__ = [
    "Components",
    "build_components",
    "build_layer_plan",
    "build_loader",
    "build_model",
    "build_optimizer",
    "build_trainer",
    "make_trainer",
    "offload_settings",
    "trainer_settings",
]
