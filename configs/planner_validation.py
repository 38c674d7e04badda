# The memory planner's validation model (docs/planner.md): 12 blocks, hidden 512, sequence 512,
# micro-batch 4, fp32 on the builtin corpus. `python -m internlm_offload.bench.planner` predicts and
# measures its device peak under the memory features; ~5 s per step on 2 CPU cores.
_base_ = ["./internlm2_tiny.py"]
JOB_NAME = "planner_validation"
model = dict(num_layers=12, hidden_size=512, num_attention_heads=8, num_kv_attention_heads=4)
data = dict(seq_len=512, micro_bsz=4, micro_num=1, total_steps=3)
