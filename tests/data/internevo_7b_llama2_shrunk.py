# The key set of InternEvo's configs/7B_llama2.py, shrunk in size only (zero1 and weight sizes 1).
# Written for these tests, on top of the 7B_sft-style fixture.
_base_ = "./internevo_7b_sft_shrunk.py"
JOB_NAME = "internevo_7b_llama2_shrunk"
model_type = "LLAMA2"

ckpt = dict(
    _delete_=True,
    enable_save_ckpt=False,
    save_ckpt_folder="local:llm_ckpts",
    auto_resume=False,
    checkpoint_every=50,
    async_upload=True,
    async_upload_tmp_folder="/dev/shm/internlm_tmp_ckpt/",
    oss_snapshot_freq=25,
)
data = dict(micro_num=2, micro_bsz=1, valid_every=0)
loss = dict(_delete_=True, label_smoothing=0)
model = dict(_delete_=True, checkpoint=False, num_chunks=1, num_attention_heads=4, embed_split_hidden=True,
             vocab_size=259, embed_grad_scale=1, parallel_output=True, hidden_size=64, num_layers=2, no_bias=True,
             mlp_ratio=3.5, apply_post_layer_norm=False, dtype="torch.bfloat16", norm_type="rmsnorm",
             layer_norm_epsilon=1e-5, num_kv_attention_heads=2, use_flash_attn=True)
parallel = dict(
    _delete_=True,
    zero1=dict(size=1),
    tensor=dict(size=1, mode="isp"),
    pipeline=dict(size=1, interleaved_overlap=True),
    weight=dict(size=1, overlap=True, memory_pool=True),
)
