# A tiny DeepSeek-V3 on the native family (model/families/deepseek_v3; docs/deepseek.md), built from a config dict
# (nothing downloaded; with a Hugging Face folder give model.hf_path instead): multi-head latent attention, a dense
# first block, group-limited routing by the sigmoid router whose e_score_correction_bias moves once a step against
# each expert's load (model.router_bias_update_speed, XTuner's rule; the imbalance logged as moe_maxvio), and
# multi-token prediction: one depth predicting the token after next through one more sparse block with its own router
# and the shared embedding and head (model.mtp_config, XTuner's MTPConfig names; its loss, λ x the mean over depths,
# logged as mtp_loss; left out, config.json's num_nextn_predict_layers decides, 1 here: transformers' default).
# configs/hf_deepseek_v3_tiny.py is the same model through transformers (model.type="hf_causal_lm"), without MTP.
_base_ = ["./internlm2_tiny.py"]
JOB_NAME = "deepseek_v3_tiny"
model = dict(
    _delete_=True,
    type="deepseek_v3",
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
    mtp_config=dict(
        num_layers=1,
        share_weights=False,
        loss_scaling_factor=0.1,
        detach_mtp_inputs=False,
        detach_mtp_lm_head_weight=False,
    ),
    dtype="torch.float32",
    checkpoint=0.0,
)
