"""QLoRA's 4-bit frozen base: the decoder blocks' frozen linears held in 4 bits through bitsandbytes.

`Linear4bit` keeps a linear's weight as bitsandbytes packs it (`bitsandbytes.functional.quantize_4bit`: two 4-bit
codes a byte, one scale per 64 weights, the scales themselves quantized to 8 bits with double quantization) and
computes through `bitsandbytes.matmul_4bit` (the weight dequantized to the compute dtype for each matmul, forward
and backward; the weight takes no gradient). It is not `bitsandbytes.nn.Linear4bit`: that one quantizes when moved
to a device and keeps its scales on a Python object, which a model-wide `.to(dtype)` (the masters' cast), the meta
build of the planner and this trainer's weight loading do not go through. Here every tensor is registered on the
module: the packed weight is a frozen parameter (so checkpoints skip it as they skip any frozen base), the scales
are non-persistent buffers held as bytes (`uint8` views of their float32 values), so a dtype cast leaves them
exact and a device move carries them. Loading a full-precision weight (`load_state_dict`) quantizes it.
"""

from collections.abc import Iterator

import torch
from torch import nn

from internlm_offload.offload.hosted_base import Hostable

BLOCKSIZE = 64  # bitsandbytes' default for 4-bit weights (transformers' too)
NESTED_BLOCKSIZE = 256  # double quantization's blocks of scales (bitsandbytes' fixed choice)
_SCALES = ("absmax", "code", "offset", "absmax2", "code2")


class Linear4bit(nn.Module, Hostable):
    """A frozen linear whose weight is held in 4 bits and dequantized to `compute_dtype` for each matmul."""

    def __init__(self, linear: nn.Linear, *, quant_type: str, compute_dtype: torch.dtype, double_quant: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.quant_type, self.compute_dtype, self.double_quant = quant_type, compute_dtype, double_quant
        self.weight = nn.Parameter(torch.empty(0, dtype=torch.uint8, device=linear.weight.device), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self._dtypes: dict[str, torch.dtype] = {}
        self.quantize_(linear.weight)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"quant_type={self.quant_type}, compute_dtype={self.compute_dtype}, double_quant={self.double_quant}"
        )

    @torch.no_grad()
    def quantize_(self, weight: torch.Tensor) -> None:
        """Hold `weight` ([out, in], any float dtype) in 4 bits, rounded to the compute dtype first."""
        if weight.is_meta:
            packed, scales = _meta_quantized(weight.shape, self.double_quant)
        else:
            packed, scales = _quantized(weight.to(self.compute_dtype), self.quant_type, self.double_quant)
        # Written in place once they exist: the masters' copy of the model shares these tensors (and a base on the
        # host holds them pinned), so a base loaded from files must reach every holder.
        _store(self._parameters, "weight", packed, self)
        for name, value in scales.items():
            self._dtypes[name] = value.dtype
            as_bytes = value.reshape(-1).view(torch.uint8)  # a model-wide .to(dtype) casts float buffers
            _store(self._buffers, name, as_bytes, self)

    def host_tensor_names(self) -> list[str]:
        """What `model.lora.base_on_host` holds on the host and brings in (offload/hosted_base.py), in order."""
        names = ["weight"] if self.bias is None else ["weight", "bias"]
        return names + [name for name in _SCALES if name in self._buffers]

    @staticmethod
    def hosted_class() -> type["Linear4bit"]:
        return HostedLinear4bit

    def quant_state(self, tensors: dict[str, torch.Tensor] | None = None) -> "QuantState":  # noqa: F821
        """bitsandbytes' `QuantState` over this module's scales, or over `tensors` (their device copies)."""
        from bitsandbytes.functional import QuantState

        def scale(name: str) -> torch.Tensor:  # buffers hold the scales' bytes
            return (getattr(self, name) if tensors is None else tensors[name]).view(self._dtypes[name])

        nested = None
        if self.double_quant:
            nested = QuantState(
                absmax=scale("absmax2"), code=scale("code2"), blocksize=NESTED_BLOCKSIZE, dtype=torch.float32
            )
        return QuantState(
            absmax=scale("absmax"),
            shape=torch.Size([self.out_features, self.in_features]),
            code=scale("code"),
            blocksize=BLOCKSIZE,
            quant_type=self.quant_type,
            dtype=self.compute_dtype,
            offset=scale("offset").reshape(()) if self.double_quant else None,
            state2=nested,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import bitsandbytes as bnb

        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        out = bnb.matmul_4bit(x.to(self.compute_dtype), self.weight, quant_state=self.quant_state(), bias=bias)
        return out.to(x.dtype)

    @torch.no_grad()
    def dequantized(self) -> torch.Tensor:
        """The weight as the matmuls see it: [out, in] in the compute dtype."""
        from bitsandbytes.functional import dequantize_4bit

        return dequantize_4bit(self.weight, self.quant_state())

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
        # a full-precision [out, in] weight (a base loaded from files) is quantized; the packed one is copied
        key = prefix + "weight"
        value = state_dict.get(key)
        if value is not None and tuple(value.shape) == (self.out_features, self.in_features):
            self.quantize_(value.to(self.weight.device))
            state_dict = {k: v for k, v in state_dict.items() if k.startswith(prefix)}
            state_dict[key] = self.weight.detach()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)


class HostedLinear4bit(Linear4bit):
    """A 4-bit linear held on the host (`model.lora.base_on_host`): its packed weight and scales come in for forward
    and again for backward (`hosted.weights`), nothing of them saved; the kernels are `Linear4bit`'s."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _HostedMatmul4bit.apply(x.to(self.compute_dtype), self).to(x.dtype)

    def device_state(self) -> tuple[torch.Tensor, torch.Tensor | None, "QuantState"]:  # noqa: F821
        """The packed weight, the bias and the quant state of this module's device copies."""
        tensors = dict(zip(self.host_tensor_names(), self.hosted.weights(self)))
        return tensors["weight"], tensors.get("bias"), self.quant_state(tensors)


class _HostedMatmul4bit(torch.autograd.Function):
    """`bitsandbytes.matmul_4bit`'s forward and input gradient (its `MatMul4Bit`: the same 4-bit matmul, then
    `grad @ dequantize(W)`), the weight brought in each time instead of saved."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, module: HostedLinear4bit) -> torch.Tensor:  # noqa: ANN001
        import bitsandbytes as bnb

        ctx.module = module
        packed, bias, state = module.device_state()
        return bnb.matmul_4bit(x, packed, quant_state=state, bias=None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        from bitsandbytes.functional import dequantize_4bit

        packed, _, state = ctx.module.device_state()
        return grad.matmul(dequantize_4bit(packed, state).to(grad.dtype)), None


def _quantized(weight: torch.Tensor, quant_type: str, double_quant: bool) -> tuple[torch.Tensor, dict]:
    """bitsandbytes' packed weight and its scales by name."""
    from bitsandbytes.functional import quantize_4bit

    packed, state = quantize_4bit(
        weight.contiguous(), blocksize=BLOCKSIZE, compress_statistics=double_quant, quant_type=quant_type
    )
    scales = {"absmax": state.absmax, "code": state.code}
    if double_quant:
        scales.update(offset=state.offset, absmax2=state.state2.absmax, code2=state.state2.code)
    return packed, scales


def _meta_quantized(shape: torch.Size, double_quant: bool) -> tuple[torch.Tensor, dict]:
    """The tensors `_quantized` makes, on meta (the planner's trace): bitsandbytes' own call on meta would leave
    its cached 8-bit code on meta for every later real call of the process."""
    numel = shape.numel()
    blocks = -(-numel // BLOCKSIZE)
    meta = dict(device="meta")
    packed = torch.empty((numel + 1) // 2, 1, dtype=torch.uint8, **meta)
    scales = {"absmax": torch.empty(blocks, dtype=torch.float32, **meta), "code": torch.empty(16, **meta)}
    if double_quant:
        scales.update(
            absmax=torch.empty(blocks, dtype=torch.uint8, **meta),
            offset=torch.empty((), **meta),
            absmax2=torch.empty(-(-blocks // NESTED_BLOCKSIZE), **meta),
            code2=torch.empty(256, **meta),
        )
    return packed, scales


def quantize_base(
    blocks: nn.ModuleList,
    *,
    quant_type: str,
    compute_dtype: torch.dtype,
    double_quant: bool,
    skip: list[str] | None = None,
) -> int:
    """Replace every frozen `nn.Linear` of `blocks` (PEFT's `base_layer`s and the linears no adapter targets) by a
    `Linear4bit`, except those whose name ends with one of `skip` (before PEFT's `.base_layer`); the count."""
    skip = skip or []
    count = 0
    for block in blocks:
        for name, module in list(block.named_modules()):
            if not isinstance(module, nn.Linear) or module.weight.requires_grad:
                continue
            plain = name.removesuffix(".base_layer")
            if any(plain == s or plain.endswith("." + s) for s in skip):
                continue
            parent, _, leaf = name.rpartition(".")
            quantized = Linear4bit(
                module, quant_type=quant_type, compute_dtype=compute_dtype, double_quant=double_quant
            )
            setattr(block.get_submodule(parent) if parent else block, leaf, quantized)
            count += 1
    return count


def quantized_linears(model: nn.Module) -> Iterator[tuple[str, Linear4bit]]:
    return ((name, m) for name, m in model.named_modules() if isinstance(m, Linear4bit))


def full_weight_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """{state-dict name: [out, in]} of the 4-bit weights: the shapes their files hold."""
    return {f"{name}.weight": torch.Size([m.out_features, m.in_features]) for name, m in quantized_linears(model)}


def _store(held: dict, name: str, value: torch.Tensor, module: nn.Module) -> None:
    """`value` into the tensor `held[name]` in place when it has its shape, else registered anew."""
    current = held.get(name)
    if current is not None and current.shape == value.shape and current.dtype == value.dtype:
        current.copy_(value)
    elif name == "weight":
        current.data = value.to(current.device)
    else:
        module.register_buffer(name, value.to(module.weight.device), persistent=False)


def scale_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The 4-bit weights' scales (buffers): the base's bytes beside the packed weights."""
    return [getattr(m, name) for _, m in quantized_linears(model) for name in _SCALES if hasattr(m, name)]
