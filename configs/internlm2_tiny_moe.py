# The tiny decoder with mixture-of-experts blocks (docs/moe.md): InternEvo's GShard MoE, 4 experts, top-2, one
# shared expert; the load-balancing loss weighted by loss.moe_loss_coeff and logged as moe_aux_loss.
_base_ = ["./internlm2_tiny.py"]
JOB_NAME = "internlm2_tiny_moe"
model = dict(
    num_experts=4,
    top_k=2,
    moe_type="GShard",
    num_shared_experts=1,
    mlp_ratio=1.0,  # expert width: hidden_size * mlp_ratio, rounded up to multiple_of
    # GShard's defaults: moe_layer_kwargs=dict(capacity_factor=1.0, min_capacity=4, drop_tokens=True); with
    # moe_type="Dropless" its own (normalize_expert_weights, scoring_func, routed_scaling_factor, aux_loss_by_layer)
)
loss = dict(moe_loss_coeff=0.01)
