"""The config schema's sections: one pydantic model per section of a config file, strict, unknown keys forbidden.

Each field's description is the config reference (`python -m internlm_offload.tools.config_reference` renders
docs/config_reference.md); the whole run's model, its cross-field checks and the resolution live in
`schema.py` and `resolve.py`.
"""

import math
from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from internlm_offload.config.base import Section
from internlm_offload.config.lora import LoraConfig, check_lora
from internlm_offload.config.moe import MoeLayerKwargsConfig, check_moe
from internlm_offload.config.mtp import MtpConfig, resolve_mtp
from internlm_offload.config.quantization import QuantizationConfig, check_quantization
from internlm_offload.config.sizes import parse_size
from internlm_offload.family import check_model_section

# Knobs a config may set to "auto" (with `memory_budget`): the memory planner chooses them at start-up.
AUTO = "auto"
AUTO_KNOBS = (
    "model.checkpoint",
    "cpu_offloading.enable",
    "cpu_offloading.num_layers",
    "swap_optimizer",
    "hybrid_optimizer.enable",
    "hybrid_optimizer.offload_fraction",
    "parallel.fsdp_cpu_offload",
    "parallel.mode",
    "grad_offload",
    "nvme_offload.enable",
    "parallel.tensor.mode",
    "parallel.expert.size",
    "model.lora.base_on_host",
    "parallel.pipeline.size",
    "parallel.pipeline.mode",
    "model.num_chunks",
)
TENSOR_MODES = ("mtp", "msp", "fsp", "isp")  # InternEvo's `parallel.tensor.mode`s


def intermediate_size(hidden_size: int, mlp_ratio: float, multiple_of: int) -> int:
    """SwiGLU's hidden width: `hidden_size * mlp_ratio`, truncated, then rounded up to a multiple of `multiple_of`."""
    return multiple_of * math.ceil(int(hidden_size * mlp_ratio) / multiple_of)


class ModelConfig(Section):
    type: str = Field(
        "internlm2",
        description="The model family (internlm_offload/model/families/): `internlm2`, the native decoder, or "
        "`hf_causal_lm`, a transformers model; a family registered by `custom_imports` by its name.",
    )
    num_layers: int = Field(4, ge=1, description="Number of decoder blocks (`model.layers`).")
    hidden_size: int = Field(128, ge=1, description="Model width.")
    num_attention_heads: int = Field(4, ge=1, description="Query heads.")
    num_kv_attention_heads: Optional[int] = Field(
        None, ge=1, description="Key/value heads (grouped-query attention); default: `num_attention_heads`."
    )
    mlp_ratio: float = Field(8 / 3, gt=0, description="SwiGLU hidden size as a multiple of `hidden_size`.")
    multiple_of: int = Field(64, ge=1, description="SwiGLU hidden size is rounded up to a multiple of this.")
    vocab_size: int = Field(259, ge=1, description="Embedding rows; must be >= the tokenizer's vocabulary.")
    dtype: Literal["torch.float32", "torch.bfloat16", "torch.float16"] = Field(
        "torch.float32",
        description="Compute dtype of the forward and backward (a string: config files hold no imports). With "
        "`mixed_precision.master_weights` (the default) the optimizer steps fp32 master weights with fp32 states "
        "and gradients are accumulated and clipped in fp32, as in InternEvo; `torch.float16` adds dynamic loss "
        "scaling (`grad_scaler`).",
    )
    checkpoint: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Activation checkpointing: fraction of the blocks recomputed in backward "
        "(`True` = 1.0). Blocks `[cpu_offloading.num_layers, int(num_layers * checkpoint))` are checkpointed. "
        "Saves their activations, costs about one extra forward of those blocks. "
        '`"auto"` (with `memory_budget`): the planner chooses.',
    )
    norm_eps: float = Field(1e-6, gt=0, description="RMSNorm epsilon.")
    rope_base: float = Field(10000.0, gt=0, description="RoPE base frequency.")
    tie_word_embeddings: bool = Field(False, description="Share the embedding and output-head weights.")
    num_chunks: int = Field(
        1, ge=1, description="InternEvo's interleaved pipeline chunks per rank (virtual stages; `parallel.pipeline`)."
    )
    attention_bias: bool = Field(
        False,
        description="Biases on the attention projections wq, wk, wv, wo (InternLM v1; InternEvo's `no_bias=False`; "
        "Llama's `attention_bias`). The MLP and head never have biases.",
    )
    qkv_bias: Optional[bool] = Field(
        None,
        description="Biases on wq, wk, wv (InternEvo's `qkv_bias`, Qwen2's); default: `attention_bias`.",
    )
    o_bias: Optional[bool] = Field(
        None, description="A bias on wo (InternEvo's `o_bias`; Qwen2 has none); default: `attention_bias`."
    )
    head_dim: Optional[int] = Field(
        None,
        ge=2,
        multiple_of=2,
        description="Width of one attention head (Qwen3's `head_dim`: 128 with hidden 2048 and 32 heads); default "
        "`hidden_size / num_attention_heads`.",
    )
    qk_norm: bool = Field(
        False,
        description="RMSNorm of q and k over each head's `head_dim`, before RoPE (Qwen3; InternEvo's `use_qk_norm`).",
    )
    num_experts: int = Field(
        0,
        ge=0,
        description="Mixture of experts: routed experts per sparse block (model/moe.py); 0: every block dense.",
    )
    top_k: int = Field(1, ge=1, description="Experts each token is routed to (<= `num_experts`).")
    moe_type: str = Field(
        "GShard",
        description="`GShard`: capacity per expert, choices over it dropped (InternEvo's fused gating); "
        "`Dropless`: every routed choice computed. InternEvo's MegaBlock variants need GPU-only packages: refused.",
    )
    num_shared_experts: int = Field(
        0,
        ge=0,
        description="Shared experts: one SwiGLU of `num_shared_experts` times the expert width, run on every token "
        "(InternEvo's `residual_mlp`; `moe_use_residual=True` means 1).",
    )
    moe_use_residual: Optional[bool] = Field(
        None, description="InternEvo's legacy name: True is `num_shared_experts=1`."
    )
    shared_expert_gate: Literal["softmax", "sigmoid", "none"] = Field(
        "softmax",
        description="How shared experts mix in: `softmax`, out = routed * c0 + shared * c1 with c = softmax(Linear(H, "
        "2)) (InternEvo's InternLM-MoE and Mixtral); `sigmoid`, out = routed + sigmoid(Linear(H, 1, no bias)) * "
        "shared (Qwen2-MoE's `shared_expert_gate`); `none`, out = routed + shared, no gate (DeepSeek-V3's and GLM-4.5's "
        "`shared_experts`, `n_shared_experts` of `moe_intermediate_size` each).",
    )
    moe_layer_kwargs: MoeLayerKwargsConfig = Field(
        default_factory=MoeLayerKwargsConfig, description="InternEvo's per-layer MoE options (below)."
    )
    mlp_only_layers: list[int] = Field(
        [], description="Qwen's: blocks (0-based) kept dense in a mixture-of-experts model."
    )
    decoder_sparse_step: int = Field(
        1, ge=1, description="Qwen's: block i is sparse iff (i + 1) % decoder_sparse_step == 0 (1: all)."
    )
    dense_intermediate_size: Optional[int] = Field(
        None,
        ge=1,
        description="SwiGLU width of the dense blocks of a mixture-of-experts model (Qwen's `intermediate_size`); "
        "default: the expert width (`hidden_size * mlp_ratio` rounded up to `multiple_of`).",
    )
    router_bias_update_speed: float = Field(
        0.001,
        ge=0,
        description="Routers that pick experts with an `e_score_correction_bias` (DeepSeek-V3's auxiliary-loss-free "
        "balancing; `hf_causal_lm` models of deepseek_v3, deepseek_v32, glm4_moe, glm4_moe_lite, glm_moe_dsa; native "
        "sparse blocks with `moe_layer_kwargs.score_correction_bias`): once a step, after backward and before "
        "clipping, each router's bias goes down by this much for the experts chosen more often than the router's mean "
        "over the step's training tokens (all micro-batches, all ranks) and up for those "
        "chosen less (XTuner's `router_bias_update_speed`; the bias is an fp32 buffer, saved in checkpoints). 0: the "
        "bias stays as loaded; so it does under `model.lora` (the bias is part of the frozen base, and a LoRA "
        "checkpoint holds the adapters alone). `moe_maxvio` in metrics.jsonl: XTuner's max violation of those counts. "
        "No effect on other models.",
    )
    balancing_loss: Literal["global_batch", "micro_batch", "sequence", "transformers"] | None = Field(
        None,
        description="A load-balancing loss of the routers (model.type='deepseek_v3': beside the router bias, "
        "global_batch / micro_batch / sequence; 'qwen3_next' (its experts) and 'gpt_oss': transformers / "
        "global_batch / micro_batch; others refuse it), weighted by `loss.moe_loss_coeff`, which must then be set, "
        "and logged as `moe_aux_loss`. None: deepseek_v3 none, as transformers trains these folders (the bias alone "
        "balances); qwen3_next and gpt_oss transformers' own where config.json sets `output_router_logits` (weighted "
        "by its `router_aux_loss_coef`, as transformers adds it; refused under a pipeline), else none. "
        "`global_batch`: XTuner's `BalancingLossConfig(balancing_loss_global_average=True)`, the default of its MoE "
        "configs with alpha 0.001: per sparse block, E / (T k) * sum_e (choices of e) * (mean over tokens of the "
        "router weights of e: the bias router's biased scores normalised, a softmax router's softmax over all "
        "experts), the counts and means over every rank's micro-batch (all-reduced inside the loss, the weights' sum "
        "with its gradient), summed over the blocks. `micro_batch`: the same over this rank's micro-batch "
        "(XTuner's `balancing_loss_global_average=False`). `sequence`: DeepSeek-V3's sequence-wise balance loss "
        "(alpha 0.0001 in its report), the same product per row of the micro-batch with the unbiased scores "
        "normalised over the experts, averaged over the rows; it needs whole rows on a rank (no tensor parallel). "
        "`transformers`: transformers' `load_balancing_loss_func` (Qwen3-Next, Qwen3.5-MoE, GPT-OSS with "
        "`output_router_logits`; their `router_aux_loss_coef` is 0.001), E * sum_e (choices of e / N) * (softmax "
        "mass of e / N), both pooled over every sparse block and token of the micro-batch (N = blocks x tokens) "
        "before the product. Under a pipeline every kind is refused (not split over stages yet).",
    )
    init_std: float = Field(0.02, gt=0, description="Std of the normal weight init.")
    parallel_output: bool = Field(
        True,
        description="Under tensor parallel (`parallel.tensor.size > 1`): the head's logits stay vocab-sharded and "
        "the loss is computed on the shards (torch's `loss_parallel`), as InternEvo's `parallel_output=True`; False "
        "gathers the whole logits on every rank. No effect otherwise.",
    )
    attn_impl: Literal["auto", "sdpa", "flash", "eager"] = Field(
        "auto",
        description="Attention kernel: `sdpa`, `flash` (flash-attn; `flash_attention_2` for `hf_causal_lm`), "
        "`eager` (`hf_causal_lm` only), `auto` (internlm2: flash-attn on CUDA when installed; hf_causal_lm: sdpa, "
        "or eager where the architecture refuses sdpa, logged).",
    )
    trust_remote_code: bool = Field(
        False,
        description="`hf_causal_lm` only: run the model code shipped in `hf_path` (InternLM2 checkpoints need it).",
    )
    hf_path: Optional[str] = Field(None, description="`hf_causal_lm` only: local directory of a Hugging Face model.")
    hf_config: Optional[dict] = Field(
        None, description="`hf_causal_lm` only: a Hugging Face config dict (with `model_type`) to build from scratch."
    )
    mtp_config: MtpConfig | None = Field(
        None,
        description="Multi-token prediction (docs/deepseek.md; `model.type='deepseek_v3'` and 'qwen3_next', "
        "docs/qwen3_next.md): `dict(num_layers, "
        "share_weights=False, loss_scaling_factor=0.1, detach_mtp_inputs=False, detach_mtp_lm_head_weight=False)`, "
        "XTuner's `MTPConfig` names. None (unset): the model's config.json `num_nextn_predict_layers` (qwen3_next: "
        "`mtp_num_hidden_layers`) depths sharing one "
        "block, λ 0.1, as XTuner's GLM-5.2 `from_hf`; off under `model.lora`. Resolved at start-up (the checkpoint's "
        "config holds the values). Other families: only None or `num_layers=0`.",
    )
    lora: Optional[LoraConfig] = Field(
        None,
        description="LoRA fine-tuning (docs/lora.md): `dict(r=8, lora_alpha=8, lora_dropout=0.0, target_modules=None, "
        'bias="none")` with PEFT\'s names and defaults; the base stays frozen in the compute dtype, only the '
        "adapters train. None: every parameter trains.",
    )
    quantization_config: Optional[QuantizationConfig] = Field(
        None,
        description="QLoRA (docs/lora.md): `dict(load_in_4bit=True, bnb_4bit_quant_type='nf4', "
        "bnb_4bit_compute_dtype=None, bnb_4bit_use_double_quant=False, llm_int8_skip_modules=None)`, "
        "`transformers.BitsAndBytesConfig`'s names: the frozen base's block linears held in 4 bits through "
        "bitsandbytes. Needs `model.lora`; `parallel.mode='none'`.",
    )

    @field_validator("checkpoint", mode="before")
    @classmethod
    def _bool_checkpoint(cls, value: Any) -> Any:
        return float(value) if isinstance(value, bool) else value

    @field_validator("mlp_only_layers", mode="before")
    @classmethod
    def _tuple_layers(cls, value: Any) -> Any:
        return list(value) if isinstance(value, tuple) else value

    @model_validator(mode="after")
    def _derive(self) -> "ModelConfig":
        if self.num_kv_attention_heads is None:
            self.num_kv_attention_heads = self.num_attention_heads
        check_moe(self)
        check_lora(self)
        check_quantization(self)
        check_model_section(self)
        self.mtp_config = resolve_mtp(self)
        return self


class DataConfig(Section):
    type: str = Field(
        "builtin",
        description="Registered dataset: `builtin` (text shipped with Python), `text` (`paths`), `internevo` "
        "(InternEvo's tokenized `.bin`/`.bin.meta` folders; `builtin` becomes `internevo` when `train_folder` is set), "
        "or `chat` (XTuner's chat jsonl in `paths`, with the `tokenizer`'s chat template; docs/migrating.md).",
    )
    paths: list[str] = Field(
        [], description="`text`: `.txt`/`.jsonl` files or folders of them; `chat`: `.jsonl` files or folders."
    )
    chat_template: Optional[str] = Field(
        None,
        description="`chat`: a Jinja chat template, or a `.jinja` file holding one; default: the tokenizer's own.",
    )
    chat_format: Literal["messages", "alpaca", "oasst1"] = Field(
        "messages",
        description="`chat`: the lines' format: `messages` (XTuner v1's OpenAI format), or XTuner's classic `alpaca` "
        '(`{"instruction", "input", "output"}`) / `oasst1` (`{"text": "### Human: ... ### Assistant: ..."}`), read as '
        "its alpaca_map_fn / oasst1_map_fn read them (data/chat_formats.py).",
    )
    max_length: Optional[int] = Field(
        None,
        ge=1,
        description="`chat`: conversations are cut to this many tokens (XTuner's `max_length`); default `seq_len`. A "
        "conversation with no trained token left after the cut is dropped (counted in the log).",
    )
    max_bad_fraction: float = Field(
        0.01,
        ge=0.0,
        le=1.0,
        description="`chat`: lines that hold no usable conversation (not JSON, unknown role, nothing to train) are "
        "skipped and reported with file and line; more than this fraction of them stops the run (exit 2).",
    )
    tokenizer: str = Field(
        "byte",
        description="`byte` (259 tokens), a local Hugging Face tokenizer folder, or a hub id (`Qwen/Qwen3-4B`) "
        "already in the local Hugging Face cache (read offline, never downloaded).",
    )
    seq_len: int = Field(128, ge=2, description="Tokens per sample.")
    micro_bsz: int = Field(2, ge=1, description="Samples per micro-batch, per rank.")
    micro_num: int = Field(1, ge=1, description="Micro-batches per step (gradient accumulation), per rank.")
    global_bsz: Optional[int] = Field(
        None,
        ge=1,
        description="Samples per optimizer step over all ranks. When set, `micro_num` is derived as "
        "`global_bsz / (micro_bsz * data-parallel ranks)` (the world size over `parallel.tensor.size`), so runs on "
        "different world sizes see the same batches.",
    )
    total_steps: int = Field(100, ge=1, description="Optimizer steps to train.")
    shuffle: bool = Field(True, description="Shuffle samples each epoch (seeded).")
    seed: Optional[int] = Field(None, description="Sampler seed; default: the top-level `seed`.")
    train_folder: Optional[str] = Field(
        None,
        description="`internevo`: folder searched recursively for InternEvo-tokenized `.bin` files (JSON lines "
        '`{"tokens": [...]}`) with their `.bin.meta` indexes. Token ids <= 0 carry no loss, as in InternEvo.',
    )
    pack_sample_into_one: Optional[bool] = Field(
        None,
        description="`internevo`: `False` (default, InternEvo's) packs `seq_len * micro_bsz` tokens per micro-batch "
        "as one row with documents kept apart (attention never crosses a document, positions restart); `True` cuts "
        "the document stream into `micro_bsz` rows of `seq_len`. `builtin`/`text` always pack into one.",
    )
    min_length: int = Field(0, ge=0, description="`internevo`: drop documents shorter than this many tokens.")
    skip_batches: str = Field(
        "",
        description='Batches to draw and discard, by 0-based index in the data stream: "3-5,8" (InternEvo\'s '
        "format, ranges inclusive and ascending). The run still makes `total_steps` optimizer steps.",
    )
    valid_folder: Optional[str] = Field(
        None,
        description="InternEvo-tokenized validation data: each folder below it holding `.bin` files is one set, "
        "named after the folder. Documents are cut to `seq_len`, split over the ranks, not packed.",
    )
    valid_every: int = Field(0, ge=0, description="Validate after every N-th step (needs `valid_folder`); 0: never.")
    valid_micro_num: int = Field(
        1,
        ge=1,
        description="Validation batch: `valid_micro_num * micro_bsz` documents per rank; the tail of a set that "
        "does not fill a batch on every rank is skipped (InternEvo's rule).",
    )

    @field_validator("paths", mode="before")
    @classmethod
    def _tuple_paths(cls, value: Any) -> Any:
        return list(value) if isinstance(value, tuple) else value

    @field_validator("skip_batches", mode="before")
    @classmethod
    def _int_skip_batches(cls, value: Any) -> Any:
        # `--cfg-options data.skip_batches=8` arrives as an int
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @model_validator(mode="after")
    def _derive(self) -> "DataConfig":
        if self.train_folder is not None and self.type == "builtin":  # builtin = "no data given"
            self.type = "internevo"
        if self.type == "chat" and not self.paths:
            raise ValueError("data.type='chat' needs data.paths (.jsonl files or folders of XTuner chat data)")
        if self.type == "internevo" and self.train_folder is None:
            raise ValueError("data.type='internevo' needs data.train_folder (a folder of .bin/.bin.meta files)")
        if self.chat_format != "messages" and self.type != "chat":
            raise ValueError(f"data.chat_format={self.chat_format!r} is read by data.type='chat', not {self.type!r}")
        if self.type in ("internevo", "chat"):
            if self.pack_sample_into_one is None:
                self.pack_sample_into_one = False
        else:
            if self.train_folder is not None:
                raise ValueError(f"data.train_folder is read by data.type='internevo', not {self.type!r}")
            if self.pack_sample_into_one is False:
                raise ValueError(
                    f"data.pack_sample_into_one=False (documents kept apart) needs data.type='internevo' or 'chat'; "
                    f"{self.type!r} packs documents into one stream"
                )
            self.pack_sample_into_one = True
        if self.valid_every and self.valid_folder is None:
            raise ValueError(f"data.valid_every={self.valid_every} needs data.valid_folder")
        self.skip_ranges()  # validates the string
        return self

    @property
    def keeps_documents_apart(self) -> bool:
        """Several documents per row kept apart by position ids that restart at each one (`pack_sample_into_one=False`)."""
        return self.type in ("internevo", "chat") and not self.pack_sample_into_one

    def skip_ranges(self) -> list[tuple[int, int]]:
        """`skip_batches` as ascending inclusive (first, last) ranges."""
        ranges: list[tuple[int, int]] = []
        for part in filter(None, (p.strip() for p in self.skip_batches.split(","))):
            first, _, last = part.partition("-")
            if not (first.isdigit() and (last.isdigit() or not last)):
                raise ValueError(f'data.skip_batches={self.skip_batches!r}: {part!r} is not N or N-M (e.g. "3-5,8")')
            lo, hi = int(first), int(last or first)
            if hi < lo or (ranges and lo <= ranges[-1][1]):
                raise ValueError(f"data.skip_batches={self.skip_batches!r}: ranges must be ascending and not overlap")
            ranges.append((lo, hi))
        return ranges


class AdamConfig(Section):
    lr: float = Field(1e-3, gt=0, description="Peak learning rate.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1 (first-moment decay).")
    adam_beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2 (second-moment decay).")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    weight_decay: float = Field(0.01, ge=0, description="Decoupled weight decay, applied to matrices only.")
    fused: Optional[bool] = Field(None, description="Fused AdamW kernel; default: on where the device has it.")


class LrSchedulerConfig(Section):
    type: Literal["cosine", "linear", "constant"] = Field(
        "cosine",
        description="Decay after the warmup: `cosine` (InternEvo's), `linear` or `constant` (XTuner's `lr_type`).",
    )
    warmup_ratio: float = Field(0.05, ge=0, le=1, description="Linear warmup over this fraction of the steps.")
    eta_min: float = Field(1e-5, ge=0, description="Final learning rate of the decay (`cosine`, `linear`).")
    total_steps: Optional[int] = Field(None, ge=1, description="Schedule length; default: `data.total_steps`.")


class HybridZeroOptimizerConfig(Section):
    clip_grad_norm: float = Field(1.0, ge=0, description="Clip the global gradient norm to this; 0 disables.")


class LoadCkptInfo(Section):
    path: str = Field(description="A run's checkpoint folder (its latest checkpoint is taken) or one `step_*` folder.")
    content: list[Literal["model", "all"]] = Field(
        ["model"],
        description='`("model",)`: weights only; the run starts at step 1 with a fresh optimizer, schedule and data '
        'order. `("all",)`: a full resume (step, optimizer, schedule, data position).',
    )
    ckpt_type: Literal["internevo", "hf", "hf_llama", "llama"] = Field(
        "internevo",
        description="Checkpoint format: `internevo`: this trainer's own (DCP) checkpoints, or InternEvo's model files "
        "(`model_tp*_pp*.pt`, `model_wp*_pp*.pt`, any tp/wp/pp/FSDP layout); `hf` / `hf_llama`: a Hugging Face "
        "InternLM2 or Llama folder; `llama`: Meta's consolidated Llama folder. The last three load weights only "
        "into `model.type='internlm2'` (docs/migrating.md).",
    )

    @field_validator("content", mode="before")
    @classmethod
    def _tuple_content(cls, value: Any) -> Any:
        return list(value) if isinstance(value, tuple) else value

    @model_validator(mode="after")
    def _one_content(self) -> "LoadCkptInfo":
        if len(self.content) != 1:
            raise ValueError(f'ckpt.load_ckpt_info.content={tuple(self.content)!r}: use ("model",) or ("all",)')
        return self


class CkptConfig(Section):
    save_ckpt_folder: Optional[str] = Field(None, description="Checkpoint folder; default `<work_dir>/checkpoints`.")
    checkpoint_every: int = Field(0, ge=0, description="Save every N steps (0: only at the end).")
    enable_save_ckpt: bool = Field(True, description="Write checkpoints at all.")
    keep_last: int = Field(2, ge=0, description="Keep the newest N checkpoints (0 keeps all).")
    load_ckpt_folder: Optional[str] = Field(
        None, description="Start from this checkpoint (a `step_*` folder or a checkpoint folder's latest)."
    )
    auto_resume: bool = Field(False, description="Continue from the latest checkpoint in `save_ckpt_folder`.")
    load_ckpt_info: Optional[LoadCkptInfo] = Field(
        None,
        description="Start from another run's checkpoint, or another trainer's model weights: `dict(path=..., "
        'content=("model",), ckpt_type="internevo"|"hf"|"hf_llama"|"llama")` (docs/migrating.md).',
    )


class MonitorConfig(Section):
    log_every: int = Field(1, ge=1, description="Log a line every N steps (metrics.jsonl gets every step).")
    tensorboard: bool = Field(
        False,
        description="Also write metrics.jsonl's numbers to TensorBoard in `<work_dir>/tensorboard` (rank 0; needs "
        "`pip install 'internlm_offload[tb]'`). InternEvo's `monitor.tensorboard` / `enable_tb` set it.",
    )
    progress_bar: Literal["auto", "on", "off"] = Field(
        "auto", description="`auto`: a bar on a TTY, log lines otherwise."
    )
    profile_step: int = Field(
        0,
        ge=0,
        description="Run this step (counted from 1) under `torch.profiler` and write a Chrome trace per rank to "
        "`<work_dir>/profile/step<N>_rank<R>.json.gz`; 0: never. `python -m internlm_offload.tools.trace_overlap "
        "TRACE` measures how much of the offload copying overlaps compute. XTuner's `profile_step` sets it.",
    )


class CpuOffloadingConfig(Section):
    enable: bool = Field(
        False,
        description="Offload saved activations of the first `num_layers` blocks to host. "
        '`"auto"` (with `memory_budget`): the planner chooses.',
    )
    num_layers: int | list[int] = Field(
        0,
        description="Blocks whose activations go to host memory; < `model.num_layers`. Under a pipeline: the "
        "first `num_layers` of each rank's own blocks in stage order (< the rank's blocks), each stage's micro-batches "
        "in flight on the host until their backward; a list gives each pipeline rank its own count (one entry per "
        "rank of `parallel.pipeline.size`, e.g. `[2, 1, 0, 0]`: the early stages hold the most micro-batches in "
        'flight; docs/parallelism.md). `"auto"` (with `memory_budget`): the planner chooses (and sets `enable`; '
        "under a pipeline, per rank).",
    )
    mode: Literal["auto", "sync", "async"] = Field(
        "auto",
        description="`async` overlaps copies with compute on side streams; `sync` copies on the compute stream. "
        "`auto`: `async`, except `sync` on NPU, where async copies from pinned memory are unreliable.",
    )
    min_offload_bytes: int = Field(1024, ge=0, description="Smaller saved tensors stay on the device.")
    prefetch_layers: int = Field(1, ge=1, description="Groups reloaded ahead during backward.")
    pin_memory: bool = Field(True, description="Pinned host buffers where the device supports them.")

    @field_validator("num_layers")
    @classmethod
    def _counts(cls, value: int | list[int]) -> int | list[int]:
        counts = value if isinstance(value, list) else [value]
        if not counts or min(counts) < 0:
            raise ValueError(f"cpu_offloading.num_layers={value!r}: give a block count >= 0, or one per pipeline rank")
        return value

    def layers_on(self, pp_rank: int) -> int:
        """The blocks pipeline rank `pp_rank` offloads (the one count without a pipeline)."""
        return self.num_layers[pp_rank] if isinstance(self.num_layers, list) else self.num_layers

    @property
    def most_layers(self) -> int:
        """The largest count of any rank: what the rules on the model's blocks check."""
        return max(self.num_layers) if isinstance(self.num_layers, list) else self.num_layers


class NvmeOffloadConfig(Section):
    enable: bool = Field(
        False,
        description="Keep the offloaded optimizer states in files under `path` (the NVMe tier): the swap "
        "optimizer's, or the hybrid optimizer's CPU share's; host memory then holds the chunks in flight only. "
        'Needs `path` and `swap_optimizer` or `hybrid_optimizer`. `"auto"` (with `memory_budget`): the planner '
        "chooses.",
    )
    path: Optional[str] = Field(
        None,
        description="Directory on a local NVMe drive: files per rank, reserved at start (a missing or full directory "
        "is an error then, not when the config is validated: the planner may run elsewhere), removed when the "
        "process ends. Checkpoints still go through DCP.",
    )

    @property
    def directory(self) -> str | None:
        """Where the states go when the tier is on; None when it is off."""
        return self.path if self.enable else None


class MemoryBudgetConfig(Section):
    device: Optional[int] = Field(
        None,
        description="Device memory per rank the run may use (bytes or a size like '40GiB'). Knobs set to "
        '`"auto"` are chosen by the memory planner for the fastest predicted step within it (docs/planner.md).',
    )
    host: Optional[int] = Field(None, description="Host memory per rank the planner may use; default: no limit.")
    expert_imbalance: float = Field(
        1.25,
        ge=1.0,
        description="The planner's assumption under expert parallel: the busiest rank receives this many times the "
        "mean of the rows the all-to-all brings (1: even routing; at most the expert-parallel size, every row to "
        "one rank). Its receive buffers, expert activations and FLOPs are traced at that size (docs/planner.md).",
    )

    @field_validator("device", "host", mode="before")
    @classmethod
    def _size(cls, value: Any, info: Any) -> Any:
        return None if value is None else parse_size(value, f"memory_budget.{info.field_name}")


class HybridOptimizerConfig(Section):
    enable: bool = Field(
        False,
        description="Step `offload_fraction` of the parameters on the CPU. "
        '`"auto"` (with `memory_budget`): the planner chooses.',
    )
    offload_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Fraction of parameter elements stepped on the CPU. "
        '`"auto"` (with `memory_budget`): the planner chooses (0.5 or 1.0).',
    )
    overlap_cpu_optimizer_d2h_h2d: bool = Field(True, description="Overlap grad D2H / param H2D with the CPU step.")
    param_update_in_fp32: bool = Field(False, description="Keep fp32 master copies for the CPU-stepped params.")


class LossConfig(Section):
    label_smoothing: float = Field(
        0.0, ge=0, lt=1, description="Cross-entropy label smoothing (InternEvo's `loss.label_smoothing`)."
    )
    moe_loss_coeff: float = Field(
        1.0,
        ge=0,
        description="Mixture of experts: the load-balancing loss is multiplied by this and added to the training "
        "loss (InternEvo's; its configs use 0.1 to 0.001; `deepseek_v3`, `qwen3_next`, `gpt_oss`: the loss "
        "`model.balancing_loss` names, which needs this set); logged apart as `moe_aux_loss`, already multiplied.",
    )


class MixedPrecisionConfig(Section):
    master_weights: bool = Field(
        True,
        description="With a bf16/fp16 `model.dtype`: keep fp32 master weights (and fp32 AdamW states), accumulate "
        "and clip gradients in fp32 (~16 B/param with AdamW). `False` is pure low precision: params, grads and "
        "states in `model.dtype` (~8 B/param), which saves memory but loses small updates (fine-tuning learning "
        "rates stall in bf16).",
    )


class Fp16ScaleConfig(Section):
    initial_scale: float = Field(2.0**16, gt=0, description="fp16: the initial loss scale.")
    min_scale: float = Field(1.0, gt=0, description="fp16: the loss scale never backs off below this.")
    growth_interval: int = Field(1000, ge=1, description="fp16: grow the scale after this many steps without overflow.")


class GradScalerConfig(Section):
    fp16: Fp16ScaleConfig = Field(default_factory=Fp16ScaleConfig)
    growth_factor: float = Field(
        2.0, gt=1, description="fp16: multiply the scale by this after `growth_interval` good steps."
    )
    backoff_factor: float = Field(0.5, gt=0, lt=1, description="fp16: multiply the scale by this on an overflow.")
    max_scale: float = Field(2.0**24, gt=0, description="fp16: the loss scale never grows above this.")
    hysteresis: int = Field(
        2, ge=1, description="fp16: overflows tolerated (steps still skipped) before the first back-off."
    )

    @model_validator(mode="after")
    def _ordered(self) -> "GradScalerConfig":
        lo, hi, init = self.fp16.min_scale, self.max_scale, self.fp16.initial_scale
        if not lo <= init <= hi:
            raise ValueError(
                f"grad_scaler: need fp16.min_scale <= fp16.initial_scale <= max_scale, got {lo} <= {init} <= {hi}"
            )
        return self


class CustomImportsConfig(Section):
    """mmengine's `custom_imports`: modules the config file imports as it loads (a model family of your own
    registers there: docs/architecture.md, "A new model family")."""

    imports: list[str] = Field([], description="Dotted module names, importable from the run's `PYTHONPATH`.")
    allow_failed_imports: bool = Field(False, description="mmengine's: warn instead of failing on one that fails.")
