# Swap optimizer: AdamW states live in host memory and are swapped in, parameter by parameter within a
# device budget of 1/swap_optimizer_times of the states, during optimizer.step(). Bitwise = baseline.
_base_ = ["./internlm2_tiny.py"]
JOB_NAME = "internlm2_tiny_swap"
swap_optimizer = True
swap_optimizer_times = 4
