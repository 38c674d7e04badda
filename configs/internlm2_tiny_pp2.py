# The tiny run over a 2-stage pipeline (InternEvo's pipeline section): `torchrun --nproc-per-node 2 train.py
# --config configs/internlm2_tiny_pp2.py`; on 4 processes each stage's 2 ranks are data parallel (DDP, or FSDP2 with
# --cfg-options parallel.mode=fsdp2).
# Blocks 0-1 with the embedding on stage 0, blocks 2-3 with norm, head and loss on stage 1; 1F1B over the
# 4 micro-batches of a step (docs/parallelism.md, "Pipeline parallel").
_base_ = ["./internlm2_tiny.py"]
JOB_NAME = "internlm2_tiny_pp2"
parallel = dict(pipeline=dict(size=2, interleaved_overlap=False, mode="1F1B"))
model = dict(num_chunks=1)
data = dict(micro_num=4)
