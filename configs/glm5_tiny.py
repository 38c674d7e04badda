# A tiny GLM-5 (`glm_moe_dsa`) on the native family (model/families/deepseek_v3; docs/deepseek.md, "DeepSeek Sparse
# Attention"), built from a config dict (nothing downloaded; with a Hugging Face folder give model.hf_path instead):
# MLA with a lightning indexer keeping each query's index_topk=16 best earlier keys of its own document, below the
# 128-token packs (internlm2_tiny's seq_len), so the attention really is sparse; cross-layer top-k sharing: blocks 0
# and 2 own an indexer, blocks 1 and 3 reuse the top-k of the block before (indexer_types); the indexer is frozen, as
# transformers and XTuner run it. A dense first block, sparse blocks of the bias-balanced sigmoid router.
_base_ = ["./internlm2_tiny.py"]
JOB_NAME = "glm5_tiny"
model = dict(
    _delete_=True,
    type="deepseek_v3",
    hf_config=dict(
        model_type="glm_moe_dsa",
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        index_topk=16,
        index_n_heads=8,
        index_head_dim=32,
        indexer_types=["full", "shared", "full", "shared"],
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        vocab_size=259,
    ),
    router_bias_update_speed=0.001,
    dtype="torch.float32",
    checkpoint=0.0,
)
