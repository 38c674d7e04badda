# configs/deepseek_v3_tiny.py's model through transformers (model.type="hf_causal_lm"): the same hf_config, MLA and
# the sigmoid router whose e_score_correction_bias balances the experts. transformers never updates that bias; here
# it moves once a step by model.router_bias_update_speed against each expert's load, as XTuner trains it, and the
# step's imbalance is logged as moe_maxvio. Multi-token prediction is the native family's (transformers has no MTP
# head), so it is off here.
_base_ = ["./deepseek_v3_tiny.py"]
JOB_NAME = "hf_deepseek_v3_tiny"
model = dict(type="hf_causal_lm", mtp_config=dict(num_layers=0))
