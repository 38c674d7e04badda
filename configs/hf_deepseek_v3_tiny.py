# A tiny DeepSeek-V3 (built from a config dict, nothing downloaded): multi-head latent attention (v's head dim apart
# from q/k's), the sigmoid router whose e_score_correction_bias balances the experts. transformers never updates that
# bias; here it moves once a step by model.router_bias_update_speed against each expert's load, as XTuner trains it,
# and the step's imbalance is logged as moe_maxvio.
_base_ = ["./internlm2_tiny.py"]
JOB_NAME = "hf_deepseek_v3_tiny"
model = dict(
    _delete_=True,
    type="hf_causal_lm",
    hf_config=dict(
        model_type="deepseek_v3",
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
        n_group=2,
        topk_group=1,
        vocab_size=259,
    ),
    router_bias_update_speed=0.001,
    dtype="torch.float32",
    checkpoint=0.0,
)
