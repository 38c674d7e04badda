# The key set of InternEvo's configs/8B_internlm3.py, shrunk in size only (weight size 1).
# Written for these tests, on top of the 7B_sft-style fixture.
_base_ = "./internevo_7b_sft_shrunk.py"
JOB_NAME = "internevo_8b_internlm3_shrunk"
model_type = "INTERNLM3"

ckpt = dict(
    _delete_=True,
    enable_save_ckpt=False,
    save_ckpt_folder=None,
    load_ckpt_info=dict(path=None, content=("model",), ckpt_type="hf"),
    auto_resume=False,
    checkpoint_every=50,
    async_upload=True,
    async_upload_tmp_folder="/dev/shm/internlm_tmp_ckpt/",
    oss_snapshot_freq=25,
    enable_internevo2hf_ckpt=False,
)
data = dict(micro_num=1, micro_bsz=2, valid_every=0)
hybrid_zero_optimizer = dict(overlap_sync_param=True)
model = dict(mlp_ratio=2.5, rope_base=50000000, enable_qkv_fusion=False)
parallel = dict(
    _delete_=True,
    zero1=dict(size=1),
    tensor=dict(size=1, mode="isp"),
    pipeline=dict(size=1, interleaved_overlap=True),
    weight=dict(size=1, overlap=True, launch_allgather_before="wo", forward_overlap_per="module"),
    sequence_2D=dict(enable=False, head_size=2, context_size=4, window_size=1,
                     device_placement_strategy=dict(head_first=True, interleaved=False)),
)
