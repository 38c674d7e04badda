# AdamW with linear warmup and cosine decay; InternEvo key names.
adam = dict(lr=3e-3, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, weight_decay=0.01)
lr_scheduler = dict(warmup_ratio=0.05, eta_min=3e-4)
hybrid_zero_optimizer = dict(clip_grad_norm=1.0)
