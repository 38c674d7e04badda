# The validation model with its memory knobs left to the planner: at start-up it traces the settings of
# the "auto" knobs and trains with the fastest predicted step whose device peak fits 840 MiB per rank
# (60 % of the baseline's 1.40 GiB); the log shows the choice and, after step 2, measured vs predicted.
_base_ = ["./planner_validation.py"]
JOB_NAME = "planner_validation_auto"
memory_budget = dict(device="840MiB")
model = dict(checkpoint="auto")
cpu_offloading = dict(num_layers="auto")
swap_optimizer = "auto"
hybrid_optimizer = dict(enable="auto", offload_fraction="auto")
