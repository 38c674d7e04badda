# GLM-5 (`glm_moe_dsa`) for the memory planner (docs/deepseek.md, "The planner's answers"): the architecture of
# transformers' GlmMoeDsaConfig defaults (zai-org's GLM-5: 78 blocks of hidden 6144, 3 dense-first with a SwiGLU of
# 12288, 75 sparse of 256 routed experts of 2048, top-8, one shared; MLA with 64 heads, q rank 2048, kv rank 512,
# heads of 192 + 64 / 256) with DeepSeek Sparse Attention: an indexer of 32 heads x 128, top-k 2048, and GLM-5.2's
# cross-layer schedule (XTuner's index_topk_freq=4, index_skip_topk_offset=3: blocks 0, 1, 2, 6, 10, ..., 74 own an
# indexer, 21 full and 57 shared), given as model.hf_config, so nothing is read or downloaded (on the cluster
# model.hf_path names the folder instead). Planned for a device (`device="cuda"`), sequences of 32768 tokens
# (data.seq_len=131072 for 128k), 4 micro-batches of one a rank, FSDP2 with expert parallel over 8 ranks:
#   python -m internlm_offload.tools.plan --config configs/plan_glm5.py --world-size 64 --ranks-per-node 8 \
#       --device-memory 80GiB --host-memory 2TiB --disk-memory 30TB --hardware h100
_base_ = ["./plan_deepseek_v3_671b.py"]
JOB_NAME = "plan_glm5"
model = dict(
    hf_config=dict(
        _delete_=True,
        model_type="glm_moe_dsa",
        vocab_size=154880,
        hidden_size=6144,
        intermediate_size=12288,
        moe_intermediate_size=2048,
        num_hidden_layers=78,
        num_attention_heads=64,
        num_key_value_heads=64,
        n_shared_experts=1,
        n_routed_experts=256,
        routed_scaling_factor=2.5,
        kv_lora_rank=512,
        q_lora_rank=2048,
        qk_rope_head_dim=64,
        v_head_dim=256,
        qk_nope_head_dim=192,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        norm_topk_prob=True,
        index_topk=2048,
        index_n_heads=32,
        index_head_dim=128,
        indexer_types=["full" if max(i - 2, 0) % 4 == 0 else "shared" for i in range(78)],
        max_position_embeddings=202752,
        initializer_range=0.02,
        rms_norm_eps=1e-5,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        tie_word_embeddings=False,
        attention_bias=False,
    ),
)
data = dict(seq_len=32768)
