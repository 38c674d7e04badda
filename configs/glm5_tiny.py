# A tiny GLM-5 (`glm_moe_dsa`) on the native family (model/families/deepseek_v3; docs/deepseek.md, "DeepSeek Sparse
# Attention"): configs/deepseek_v3_tiny.py's model with GLM-5's keys over it (nothing downloaded; with a Hugging Face
# folder give model.hf_path instead). MLA with a lightning indexer keeping each query's index_topk=16 best earlier keys
# of its own document, below the 128-token packs (internlm2_tiny's seq_len), so the attention really is sparse;
# cross-layer top-k sharing: blocks 0 and 2 own an indexer, blocks 1 and 3 reuse the top-k of the block before
# (indexer_types); the indexer is frozen, as transformers and XTuner run it. One expert group (GLM-5's n_group=1) and
# no multi-token prediction (GlmMoeDsaConfig has no num_nextn_predict_layers: 0).
_base_ = ["./deepseek_v3_tiny.py"]
JOB_NAME = "glm5_tiny"
model = dict(
    hf_config=dict(
        model_type="glm_moe_dsa",
        n_group=1,
        index_topk=16,
        index_n_heads=8,
        index_head_dim=32,
        indexer_types=["full", "shared", "full", "shared"],
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    ),
    mtp_config=None,
)
