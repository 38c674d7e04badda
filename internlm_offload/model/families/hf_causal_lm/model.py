"""A Hugging Face causal LM behind the same interface as InternLM2 (forward, layers, init_weights)."""

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from internlm_offload.log import get_logger
from internlm_offload.model.attention import document_mask
from internlm_offload.model.families.hf_causal_lm.routers import BIAS, RouterTaps
from internlm_offload.model.hooks import KeepsFp32Buffers
from internlm_offload.model.output import MOE_AUX, ModelOutput

logger = get_logger(__name__)

# Where common architectures keep their decoder layers: llama/mistral/qwen/internlm2, then gpt2-style.
_LAYER_PATHS = ("model.layers", "transformer.h")


def _zero_dropout(config: Any) -> list[str]:
    """Set every float dropout probability on an HF config to 0 (runs must be reproducible); return the names."""
    zeroed = []
    for name, value in vars(config).items():
        is_prob = "dropout" in name or name.endswith("pdrop")
        if is_prob and isinstance(value, float) and value != 0.0:
            setattr(config, name, 0.0)
            zeroed.append(name)
    return zeroed


def _find_layers_path(model: nn.Module, num_layers: int | None) -> str:
    """Dotted path of the decoder-layer ModuleList inside `model`."""
    for path in _LAYER_PATHS:
        try:
            if isinstance(model.get_submodule(path), nn.ModuleList):
                return path
        except AttributeError:
            continue
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            return path
    raise ValueError(
        f"cannot find the decoder layers of {type(model).__name__}: not at {' or '.join(_LAYER_PATHS)}, "
        f"and no nn.ModuleList has config.num_hidden_layers={num_layers} entries"
    )


def _clear_hf_init_flags(model: nn.Module) -> None:
    """Forget HF's `_is_hf_initialized` marks, which make a second init a silent no-op."""
    for obj in (*model.modules(), *model.parameters(), *model.buffers()):
        if hasattr(obj, "_is_hf_initialized"):
            delattr(obj, "_is_hf_initialized")


# model.attn_impl -> transformers' attn_implementation; `auto` tries sdpa, then eager.
ATTN_IMPLS = {"sdpa": "sdpa", "eager": "eager", "flash": "flash_attention_2"}


def _router_aux_coef(config: Any) -> float | None:
    """The load-balancing loss coefficient of a mixture-of-experts (text) config (Mixtral, Qwen2/3-MoE, Qwen3-Next,
    Qwen3.5-MoE, GPT-OSS), else None."""
    if not hasattr(config, "output_router_logits"):
        return None
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) or None


# Layer types (transformers' `layer_types`) that carry a recurrent or convolutional state along the row (Gated
# DeltaNet, Mamba, short convolutions, and layers mixing one with attention): none of them reads position ids.
STATEFUL_LAYER_TYPES = ("linear_attention", "mamba", "conv", "recurrent", "hybrid", "hybrid_sliding")


def stateful_layers(config: Any) -> list[int]:
    """The layers of a (text) config whose state runs along the whole row, across packed documents."""
    types = getattr(config, "layer_types", None) or []
    return [i for i, kind in enumerate(types) if kind in STATEFUL_LAYER_TYPES]


def text_config(config: Any) -> Any:
    """The config of the text decoder: a vision-language config's `text_config`, else the config itself."""
    get = getattr(config, "get_text_config", None)
    return config if get is None else get(decoder=True)


def read_text_config(path: str | None, config: dict | None, trust_remote_code: bool) -> Any:
    """`text_config` of a folder's or a dict's config; ValueError in one line naming the bad input."""
    return text_config(_load_hf_config(path, config, trust_remote_code))


def _build_hf_model(
    path: str | None,
    hf_config: Any,
    trust_remote_code: bool,
    attn: str,
    *,
    read_weights: bool = True,
    vision_language: bool = False,
) -> nn.Module:
    """`vision_language`: `hf_config` is the text config of the folder's vision-language config, whose text weights
    must all be found (transformers maps their names; what it cannot map would stay at random init, silently)."""
    from transformers import AutoModelForCausalLM

    common = dict(trust_remote_code=trust_remote_code, attn_implementation=attn)
    if path is None:
        return AutoModelForCausalLM.from_config(hf_config, **common)
    if not read_weights:  # the folder's modules without its weights (from_pretrained refuses a meta device)
        return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, **common)
    # fp32 whatever the checkpoint's dtype: the precision policy decides what is cast (masters stay fp32).
    model, info = AutoModelForCausalLM.from_pretrained(
        path, config=hf_config, local_files_only=True, dtype=torch.float32, output_loading_info=True, **common
    )
    missing = sorted(info.get("missing_keys") or ())
    if missing and vision_language:
        raise ValueError(
            f"hf_path={path!r}: {len(missing)} weights of its text model ({type(model).__name__}) are not in the "
            f"folder under names transformers maps (first: {missing[0]!r}); only the text model trains here"
        )
    return model


def _load_hf_config(path: str | None, config: dict | None, trust_remote_code: bool) -> Any:
    """The transformers config of a local folder or a dict; ValueError in one line naming the bad input."""
    from transformers import AutoConfig

    if path is not None:
        if not os.path.isdir(path):
            raise ValueError(f"hf_path={path!r} is not a local directory (nothing is downloaded)")
        try:
            return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, KeyError) as exc:
            hint = (
                "" if trust_remote_code else "; if the folder ships its own modelling code set trust_remote_code=True"
            )
            raise ValueError(f"hf_path={path!r}: transformers cannot read its config ({_short(exc)}){hint}") from None
    if "model_type" not in config:
        raise ValueError(f"hf_config needs a 'model_type' key (e.g. 'llama'); got keys {sorted(config)}")
    try:
        return AutoConfig.for_model(**config)
    except ValueError:
        import transformers

        raise ValueError(
            f"hf_config.model_type={config['model_type']!r} is not a model type transformers "
            f"{transformers.__version__} knows (e.g. 'llama', 'qwen2', 'mistral', 'gemma2', 'mixtral')"
        ) from None


def _check_text_model(config: Any, text: Any, path: str | None) -> None:
    """A vision-language config trains its text model alone: one transformers can build as a causal LM."""
    import transformers
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    where = f"hf_path={path!r}" if path is not None else f"hf_config.model_type={config.model_type!r}"
    if type(text) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(
            f"{where}: a vision-language config whose text model ({text.model_type!r}) transformers "
            f"{transformers.__version__} has no causal LM for; only text models train here"
        )
    logger.info(
        "%s is a vision-language config: its text model (%s, from text_config) trains alone, the vision tower is "
        "not built",
        config.model_type,
        MODEL_FOR_CAUSAL_LM_MAPPING[type(text)].__name__,
    )


def _check_pad_token(hf_config: Any) -> None:
    """An embedding's padding_idx must be a row of it (Phi-3's pad id fails in a shrunk vocabulary)."""
    pad, vocab = getattr(hf_config, "pad_token_id", None), getattr(hf_config, "vocab_size", None)
    if isinstance(pad, int) and isinstance(vocab, int) and not 0 <= pad < vocab:
        raise ValueError(
            f"hf_config.pad_token_id={pad} is outside the vocabulary (vocab_size={vocab}); "
            "set pad_token_id below vocab_size, or None"
        )


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) < 200 else text[:197] + "..."


class HFCausalLM(nn.Module, KeepsFp32Buffers):
    """Wraps `AutoModelForCausalLM`, built from a local checkpoint (`path`) or a config dict (`config`).

    `forward` returns a `ModelOutput`: for a mixture-of-experts model with its router load-balancing loss
    (`moe_aux`, unweighted), whose coefficient, the config's own `router_aux_loss_coef`, the wrapper holds as data
    (`aux_loss_coefficients`) for the trainer to apply. `read_weights=False` builds a
    local checkpoint's modules from its config alone, in fp32 as its weights would load (a build on meta).
    """

    def __init__(
        self,
        *,
        path: str | None = None,
        config: dict | None = None,
        trust_remote_code: bool = False,
        attn_impl: str = "auto",
        read_weights: bool = True,
    ) -> None:
        super().__init__()
        if (path is None) == (config is None):
            raise ValueError(f"HFCausalLM needs exactly one of path= and config=; got path={path!r}, config={config!r}")
        if attn_impl != "auto" and attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl={attn_impl!r} must be 'auto' or one of {sorted(ATTN_IMPLS)}")
        try:
            import transformers  # noqa: F401
        except ImportError as e:
            raise ImportError('HFCausalLM needs transformers: pip install "internlm_offload[hf]"') from e

        loaded = _load_hf_config(path, config, trust_remote_code)
        hf_config = text_config(loaded)
        vision_language = hf_config is not loaded
        if vision_language:
            _check_text_model(loaded, hf_config, path)
        _check_pad_token(hf_config)
        hf_config.use_cache = False
        zeroed = _zero_dropout(hf_config)
        if zeroed:
            logger.info("set HF dropout to 0 for reproducibility: %s", ", ".join(zeroed))

        aux_coef = _router_aux_coef(hf_config)
        # the model's own weight of each aux loss it returns (none at a coefficient of 0: the loss is not computed)
        self.aux_loss_coefficients: dict[str, float] = {} if aux_coef is None else {MOE_AUX: aux_coef}
        if hasattr(hf_config, "output_router_logits"):
            # transformers' own aux loss reads a 2-D padding mask, packed documents hand the model a 4-D one: the
            # loss is computed here from the router logits the hooks record (RouterTaps.aux_loss)
            hf_config.output_router_logits = False
        if aux_coef is not None:
            logger.info("MoE model: router aux loss weighted by router_aux_loss_coef=%g", aux_coef)
        build = functools.partial(
            _build_hf_model,
            path,
            hf_config,
            trust_remote_code,
            read_weights=read_weights,
            vision_language=vision_language,
        )
        self.hf_model = self._build(build, hf_config, attn_impl)
        self.attn_impl = self.hf_model.config._attn_implementation
        self.pretrained = path is not None
        # A path string, not the ModuleList itself: a second reference would register the layers twice.
        self._layers_path = _find_layers_path(self.hf_model, getattr(hf_config, "num_hidden_layers", None))
        self.num_layers = len(self.layers)
        self.vocab_size = self.hf_model.config.vocab_size
        aux_top_k = None if aux_coef is None else int(hf_config.num_experts_per_tok)
        self.routers = RouterTaps(self.hf_model, aux_top_k)

    @staticmethod
    def _build(build: Callable[[str], nn.Module], hf_config: Any, attn_impl: str) -> nn.Module:
        """`build(attn_implementation)`: the model; `attn_impl` "auto" tries sdpa, then eager."""
        if attn_impl != "auto":
            try:
                return build(ATTN_IMPLS[attn_impl])
            except ValueError as exc:
                if "attention implementation" not in str(exc):
                    raise
                raise ValueError(
                    f"model.attn_impl={attn_impl!r}: {hf_config.model_type} refuses it in transformers "
                    f"({' '.join(str(exc).split())[:160]}); use 'auto' or 'eager'"
                ) from None
        try:
            return build("sdpa")
        except ValueError as exc:  # transformers refuses sdpa for some architectures (Gemma2)
            if "attention implementation" not in str(exc):
                raise
            logger.warning(
                "%s does not support sdpa attention; using eager (model.attn_impl='auto')", hf_config.model_type
            )
            return build("eager")

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers (checkpointing and offload wrap these)."""
        return self.hf_model.get_submodule(self._layers_path)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> ModelOutput:
        """Logits (B, T, V) for input_ids (B, T); with an MoE model also its router aux loss (`moe_aux`, unweighted).

        `position_ids` (B, T) restarting at 0 keeps packed documents apart: flash_attention_2 reads the
        boundaries from the positions itself, sdpa and eager get a 4-D additive block-causal mask.
        """
        kwargs: dict[str, torch.Tensor] = {}
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
            if "flash" not in self.attn_impl:
                kwargs["attention_mask"] = _document_mask(position_ids, self.hf_model.dtype)
        with self.routers.tap(count=self.training) as router_logits:
            out = self.hf_model(input_ids=input_ids, use_cache=False, **kwargs)
        if not self.aux_loss_coefficients:
            return ModelOutput(out.logits)
        return ModelOutput(out.logits, {MOE_AUX: self.routers.aux_loss(router_logits)})

    def fp32_buffers(self) -> list[tuple[nn.Module, str]]:
        """(module, name) of the buffers kept in fp32 whatever the compute dtype: the routers' bias, which only picks
        experts and moves by 1e-3 a step (bf16 would round such steps away; transformers keeps it fp32 too)."""
        return [(router, BIAS) for router in self.routers.bias_routers]

    def init_weights(self) -> None:
        """Re-run HF's init from the current torch RNG when built from a config; keep pretrained weights as they are."""
        if self.pretrained:
            return
        _clear_hf_init_flags(self.hf_model)
        self.hf_model.init_weights()


def _document_mask(position_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, T, T) additive mask: 0 where a token may attend (same document, not later), dtype-min elsewhere."""
    allowed = document_mask(position_ids)
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)
