# Muon (torch.optim.Muon's algorithm) as XTuner's MuonConfig splits the model: every matrix but the embedding and
# the head steps with Muon, norms, biases, embedding and head with AdamW (`adam`). The lr adjustment
# `match_rms_adamw` (the default) scales each update to AdamW's RMS, so the AdamW-tuned lr and weight decay of the
# base config serve both. Muon keeps one fp32 state per parameter, half of AdamW's. docs/optimizer_offload.md, Muon.
_base_ = ["./internlm2_tiny.py"]
JOB_NAME = "internlm2_tiny_muon"
optimizer = dict(
    type="muon",
    muon=dict(momentum=0.95, nesterov=True, ns_steps=5, adjust_lr_fn="match_rms_adamw"),
)
