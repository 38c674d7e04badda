"""A dispatch mode that counts aten calls, expensive ones (matmuls, attention) apart from the rest."""

from torch.utils._python_dispatch import TorchDispatchMode

from internlm_offload.offload.checkpointing import EXPENSIVE_OPS


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.expensive = 0
        self.cheap = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in EXPENSIVE_OPS:
            self.expensive += 1
        else:
            self.cheap += 1
        return func(*args, **(kwargs or {}))
