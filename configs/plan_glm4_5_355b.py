# GLM-4.5 355B for the memory planner (docs/deepseek.md, "The planner's answers"): the architecture of
# zai-org/GLM-4.5's config.json, given as model.hf_config, so nothing is read or downloaded; on the cluster,
# model.hf_path names the folder instead and the plan is the same (the planner reads its config.json alone). 92 blocks:
# 3 dense-first (a SwiGLU of 12288), 89 sparse (160 routed experts of 1536, top-8, one shared); grouped-query attention
# of 96 query and 8 kv heads of 128, q/k norms, q/k/v biases, RoPE on half of each head; 353e9 parameters. Planned for a
# device, sequences of 4096 tokens, 4 micro-batches of one a rank, FSDP2 with expert parallel over 8 ranks:
#   python -m internlm_offload.tools.plan --config configs/plan_glm4_5_355b.py --world-size 8 \
#       --ranks-per-node 8 --device-memory 141GiB --host-memory 2TiB --disk-memory 30TB
_base_ = ["./_base_/data_builtin.py", "./_base_/schedule.py", "./_base_/runtime.py"]
JOB_NAME = "plan_glm4_5_355b"
device = "cuda"
deterministic = False
model = dict(
    type="deepseek_v3",
    hf_config=dict(
        model_type="glm4_moe",
        attention_bias=True,
        attention_dropout=0.0,
        head_dim=128,
        hidden_act="silu",
        hidden_size=5120,
        partial_rotary_factor=0.5,
        initializer_range=0.02,
        intermediate_size=12288,
        max_position_embeddings=131072,
        moe_intermediate_size=1536,
        norm_topk_prob=True,
        num_attention_heads=96,
        n_group=1,
        topk_group=1,
        n_routed_experts=160,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        num_hidden_layers=92,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=1000000,
        num_nextn_predict_layers=1,
        tie_word_embeddings=False,
        use_qk_norm=True,
        vocab_size=151552,
        pad_token_id=151329,
        eos_token_id=[151329, 151336, 151338],
    ),
    dtype="torch.bfloat16",
    router_bias_update_speed=0.001,
    checkpoint=0.0,
)
data = dict(seq_len=4096, micro_bsz=1, micro_num=4, global_bsz=None)
parallel = dict(mode="fsdp2", expert=dict(size=8))
