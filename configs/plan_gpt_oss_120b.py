# gpt-oss-120b for the memory planner (docs/gpt_oss.md, "The planner's answers"): the architecture of
# openai/gpt-oss-120b's config.json (its MXFP4 quantization_config left out: the experts are dequantised on load and
# trained in bf16 with fp32 masters), given as model.hf_config, so nothing is read or downloaded; model.hf_path naming
# the folder plans the same model. 36 blocks alternating a 128-token sliding window and full attention, 64 query heads
# of 64 and 8 kv heads with biases and sinks, 128 experts of 2880 (top-4) with biases, YaRN x32 from 4096; 116.8e9
# parameters. Planned for one device (`device="cuda"`), sequences of 4096 tokens, 4 micro-batches of one:
#   python -m internlm_offload.tools.plan --config configs/plan_gpt_oss_120b.py --world-size 1 \
#       --ranks-per-node 1 --device-memory 80GiB --host-memory 2TiB --disk-memory 30TB --hardware h100
_base_ = ["./_base_/data_builtin.py", "./_base_/schedule.py", "./_base_/runtime.py"]
JOB_NAME = "plan_gpt_oss_120b"
device = "cuda"
deterministic = False
model = dict(
    type="gpt_oss",
    hf_config=dict(
        model_type="gpt_oss",
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=36,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=128,
        num_experts_per_tok=4,
        experts_per_token=4,
        sliding_window=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            original_max_position_embeddings=4096,
            truncate=False,
        ),
        swiglu_limit=7.0,
        attention_bias=True,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        initializer_range=0.02,
        router_aux_loss_coef=0.9,
        output_router_logits=False,
        use_cache=True,
        pad_token_id=199999,
        eos_token_id=200002,
    ),
    dtype="torch.bfloat16",
    checkpoint=0.0,
)
data = dict(seq_len=4096, micro_bsz=1, micro_num=4, global_bsz=None)
parallel = dict(mode="fsdp2")  # one rank: FSDP2 offers its CPU offload policy (the parameters on the host)
