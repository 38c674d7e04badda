# The key set of InternEvo's configs/7B_internlm2.py, shrunk in size only (tensor and weight sizes 1):
# the 7B_sft-style fixture plus what 7B_internlm2 adds or differs in. Written for these tests.
_base_ = "./internevo_7b_sft_shrunk.py"
JOB_NAME = "internevo_7b_internlm2_shrunk"
model_type = "INTERNLM2_PUBLIC"
MLP_RATIO = 3.5

ckpt = dict(
    _delete_=True,
    enable_save_ckpt=False,
    save_ckpt_folder="local:llm_ckpts",
    auto_resume=False,
    checkpoint_every=50,
    async_upload=True,
    async_upload_tmp_folder="/dev/shm/internlm_tmp_ckpt/",
    oss_snapshot_freq=25,
    universal_ckpt=dict(enable=False, aysnc_save=True, broadcast_load=False),
)
data = dict(micro_num=4, micro_bsz=1, valid_every=0)
loss = dict(_delete_=True, label_smoothing=0)
model = dict(mlp_ratio=MLP_RATIO)
parallel = dict(
    _delete_=True,
    zero1=dict(size=-1),
    tensor=dict(size=1, mode="isp"),
    pipeline=dict(size=1, interleaved_overlap=True, mode="1f1b"),
    weight=dict(size=1, overlap=True),
)
generation = dict(ckpt_folder="/path/to/saved/ckpt", output_folder="/path/to/save/generation", batch_size=1,
                  eos_id=[2, 0], bos_id=1, max_length=100, do_sample=True, temperature=1.0, top_k=50, top_p=1.0,
                  repetition_penalty=1, length_penalty=1.0)
