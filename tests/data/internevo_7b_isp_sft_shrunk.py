# The key set of InternEvo's configs/7B_isp_sft.py, shrunk in size only (tensor and weight sizes 1).
# Written for these tests, on top of the 7B_sft-style fixture (whose ckpt section it shares).
_base_ = "./internevo_7b_sft_shrunk.py"
JOB_NAME = "internevo_7b_isp_sft_shrunk"
model_type = "INTERNLM2"

data = dict(micro_num=4, micro_bsz=2, valid_every=50)
loss = dict(label_smoothing=0, op_type="flash_vocab_parallel")
parallel = dict(
    _delete_=True,
    zero1=dict(size=-1),
    tensor=dict(size=1, mode="isp"),
    pipeline=dict(size=1, interleaved_overlap=True),
    weight=dict(size=1, overlap=True, launch_allgather_before="wo", forward_overlap_per="layer"),
    sequence_2D=dict(enable=False, head_size=2, context_size=4, window_size=1,
                     device_placement_strategy=dict(head_first=True, interleaved=False)),
)
# InternEvo's block (num_layers=3 of 32 there; 1 of the 2 blocks here)
cpu_offloading = dict(enable=True, num_layers=1)
