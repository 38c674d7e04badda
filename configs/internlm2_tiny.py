# The default run (`make train`): a 4-block InternLM2 on the builtin corpus, on CPU.
_base_ = [
    "./_base_/model_internlm2_tiny.py",
    "./_base_/data_builtin.py",
    "./_base_/schedule.py",
    "./_base_/runtime.py",
]
JOB_NAME = "internlm2_tiny"
