# Byte-level tokens of the text that ships with Python (pydoc topics): no download needed.
data = dict(
    type="builtin",
    tokenizer="byte",
    seq_len=128,
    micro_bsz=4,
    micro_num=2,
    total_steps=120,
)
