# DeepSeek-V3 671B for the memory planner (docs/deepseek.md, "The planner's answers"): the architecture of
# deepseek-ai/DeepSeek-V3's config.json (the FP8 quantization_config left out: this trainer trains bf16 with fp32
# masters), given as model.hf_config, so nothing is read or downloaded; on the cluster, model.hf_path names the folder
# instead and the plan is the same (the planner reads its config.json alone). 61 blocks: 3 dense-first (a SwiGLU of
# 18432), 58 sparse (256 routed experts of 2048, top-8 in 4 of 8 groups, one shared); MLA with 128 heads; 671e9
# parameters. Planned for a device (`device="cuda"`: MLA's attention takes SDPA's memory-efficient kernel there, not
# cpu's math path), sequences of 4096 tokens, 4 micro-batches of one a rank, FSDP2 with expert parallel over 8 ranks:
#   python -m internlm_offload.tools.plan --config configs/plan_deepseek_v3_671b.py --world-size 8 \
#       --ranks-per-node 8 --device-memory 141GiB --host-memory 2TiB --disk-memory 30TB
_base_ = ["./_base_/data_builtin.py", "./_base_/schedule.py", "./_base_/runtime.py"]
JOB_NAME = "plan_deepseek_v3_671b"
device = "cuda"
deterministic = False
model = dict(
    type="deepseek_v3",
    hf_config=dict(
        model_type="deepseek_v3",
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_nextn_predict_layers=1,
        num_attention_heads=128,
        num_key_value_heads=128,
        n_shared_experts=1,
        n_routed_experts=256,
        routed_scaling_factor=2.5,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        v_head_dim=128,
        qk_nope_head_dim=128,
        topk_method="noaux_tc",
        n_group=8,
        topk_group=4,
        num_experts_per_tok=8,
        moe_layer_freq=1,
        first_k_dense_replace=3,
        norm_topk_prob=True,
        scoring_func="sigmoid",
        hidden_act="silu",
        max_position_embeddings=163840,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        rope_theta=10000,
        rope_scaling=dict(
            type="yarn",
            factor=40,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        tie_word_embeddings=False,
        attention_bias=False,
        attention_dropout=0.0,
        bos_token_id=0,
        eos_token_id=1,
    ),
    dtype="torch.bfloat16",
    router_bias_update_speed=0.001,
    checkpoint=0.0,
)
data = dict(seq_len=4096, micro_bsz=1, micro_num=4, global_bsz=None)
parallel = dict(mode="fsdp2", expert=dict(size=8))
