# Qwen3.5-35B-A3B's text model for the memory planner (docs/qwen3_next.md, "The planner's answers"): the architecture
# of its text config (`qwen3_5_moe_text`, transformers' Qwen3_5MoeTextConfig defaults, which are this model's) given as
# model.hf_config, so nothing is read or downloaded; on the cluster, model.hf_path names a text folder instead and the
# plan is the same. 40 blocks: 30 Gated DeltaNet (16 key heads, 32 value heads of 128) and 10 gated full attention
# (16 heads, 2 kv heads of 256, RoPE on a quarter), every block 256 routed experts of 512 (top-8) beside a gated shared
# expert of 512; 34.66e9 parameters. Planned for one device (`device="cuda"`), model.dtype bf16, one
# sequence a micro-batch, 4 micro-batches a step, FSDP2 on one rank (so the planner may put the parameters on the host):
#   python -m internlm_offload.tools.plan --config configs/plan_qwen3_5_35b_a3b.py --world-size 1 \
#       --device-memory 80GiB --host-memory 512GiB --disk-memory 4TB --cfg-options data.seq_len=32768
_base_ = ["./_base_/data_builtin.py", "./_base_/schedule.py", "./_base_/runtime.py"]
JOB_NAME = "plan_qwen3_5_35b_a3b"
device = "cuda"
deterministic = False
model = dict(
    type="qwen3_next",
    hf_config=dict(
        model_type="qwen3_5_moe_text",
        vocab_size=248320,
        hidden_size=2048,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        partial_rotary_factor=0.25,
        rope_theta=10000000.0,
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=False,
        attention_bias=False,
    ),
    dtype="torch.bfloat16",
    checkpoint=0.0,
)
data = dict(seq_len=4096, micro_bsz=1, micro_num=4, global_bsz=None)
parallel = dict(mode="fsdp2")
