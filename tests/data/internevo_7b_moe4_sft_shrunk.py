# InternEvo's configs/7B_MoE4_sft.py (model_type INTERNLM_MoE: GShard, 4 experts, top-2), its keys as shipped,
# shrunk in size only (hidden, layers, vocabulary, sequence, batch, steps). Written for these tests.
JOB_NAME = "7b_moe_train"
SEQ_LEN = 64
HIDDEN_SIZE = 64
NUM_ATTENTION_HEAD = 4
MLP_RATIO = 4 / 3
NUM_LAYER = 2
VOCAB_SIZE = 259
MOE_LOSS_COEFF = 0.1
DO_ALERT = False

MODEL_ONLY_FOLDER = "local:llm_ckpts/xxxx"
SAVE_CKPT_FOLDER = "local:llm_ckpts"
LOAD_CKPT_FOLDER = "local:llm_ckpts/49"
CHECKPOINT_EVERY = 50
ckpt = dict(
    enable_save_ckpt=False,
    save_ckpt_folder=SAVE_CKPT_FOLDER,
    load_ckpt_folder="local:llm_ckpts/",
    load_ckpt_info=dict(path=MODEL_ONLY_FOLDER, content=("model",), ckpt_type="internevo"),
    auto_resume=True,
    checkpoint_every=CHECKPOINT_EVERY,
    async_upload=True,
    async_upload_tmp_folder="/dev/shm/internlm_tmp_ckpt/",
    oss_snapshot_freq=int(CHECKPOINT_EVERY / 2),
)

TRAIN_FOLDER = None
VALID_FOLDER = None
data = dict(
    seq_len=SEQ_LEN,
    micro_num=2,
    micro_bsz=2,
    valid_micro_num=4,
    valid_every=50,
    pack_sample_into_one=False,
    total_steps=3,
    skip_batches="",
    rampup_batch_size="",
    min_length=50,
    train_folder=TRAIN_FOLDER,
    valid_folder=VALID_FOLDER,
    empty_cache_and_diag_interval=200,
    diag_outlier_ratio=1.1,
)

grad_scaler = dict(
    fp16=dict(initial_scale=2**16, min_scale=1, growth_interval=1000),
    growth_factor=2,
    backoff_factor=0.5,
    max_scale=2**24,
    hysteresis=2,
)

hybrid_zero_optimizer = dict(
    overlap_sync_grad=False,
    overlap_sync_param=False,
    reduce_bucket_size=512 * 1024 * 1024,
    clip_grad_norm=1.0,
)

loss = dict(label_smoothing=0, moe_loss_coeff=MOE_LOSS_COEFF)

adam = dict(lr=1e-4, adam_beta1=0.9, adam_beta2=0.95, adam_beta2_c=0, adam_eps=1e-8, weight_decay=0.01)

lr_scheduler = dict(
    total_steps=data["total_steps"],
    init_steps=0,
    warmup_ratio=0.01,
    eta_min=1e-5,
    last_epoch=-1,
)

beta2_scheduler = dict(init_beta2=adam["adam_beta2"], c=adam["adam_beta2_c"], cur_iter=-1)

use_fp32_norm = False
model = dict(
    checkpoint=False,
    num_attention_heads=NUM_ATTENTION_HEAD,
    embed_split_hidden=True,
    vocab_size=VOCAB_SIZE,
    embed_grad_scale=1,
    parallel_output=True,
    hidden_size=HIDDEN_SIZE,
    num_layers=NUM_LAYER,
    mlp_ratio=MLP_RATIO,
    apply_post_layer_norm=False,
    dtype="torch.bfloat16",
    norm_type="rmsnorm",
    layer_norm_epsilon=1e-5,
    use_flash_attn=True,
    qk_interleaved=False,
    num_chunks=1,
    moe_type="GShard",
    num_experts=4,
    top_k=2,
)
parallel = dict(
    zero1=dict(size=-1, fsdp=False),
    tensor=dict(size=1, mode="mtp"),
    pipeline=dict(size=1, interleaved_overlap=True),
    weight=dict(size=1, overlap=True),
    expert=dict(size=-1, no_tp=False),
    expert_weight=dict(size=1, overlap=True),
)

cudnn_deterministic = False
cudnn_benchmark = False

monitor = dict(
    alert=dict(
        enable_feishu_alert=DO_ALERT,
        feishu_alert_address=None,
        light_monitor_address=None,
        alert_file_path=f"llm_alter/{JOB_NAME}_alert.log",
    ),
    tensorboard=dict(queue_max_length=10),
)

model_type = "INTERNLM_MoE"
