# A tiny Mixtral mixture-of-experts (built from a config dict, nothing downloaded). Its router
# load-balancing loss, weighted by router_aux_loss_coef, is added to the loss and logged as moe_aux_loss.
_base_ = ["./internlm2_tiny.py"]
JOB_NAME = "hf_mixtral_tiny"
model = dict(
    _delete_=True,
    type="hf_causal_lm",
    hf_config=dict(
        model_type="mixtral",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.02,
        vocab_size=259,
    ),
    dtype="torch.float32",
    checkpoint=0.0,
)
