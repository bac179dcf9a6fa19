"""Shared description of the tiny MoE fixture models (no torch needed to import this).

Used by scripts/make_model_fixtures.py (every stage) and documented in
tests/fixtures/models/README.md. Each family entry says:
  - the transformers config class and the keyword arguments it is built from
    (real config field names, tiny dims),
  - the tokenizer's special tokens (which go first / last in the vocabulary),
  - which llama.cpp chat template (a data file of the llama-cpp-python sdist) it uses,
  - the seed and the routing tweaks applied after transformers' own init.
"""

VOCAB = 320
SEQ_LENGTHS = (1, 7, 24)  # teacher-forced logits cases
GREEDY_NEW_TOKENS = 16
ROUTER_SCALE = 10.0  # router (gate) weights are multiplied by this after init
BIAS_STD = 0.05  # std of e_score_correction_bias and of attention biases
NORM_JITTER = 0.1  # RMSNorm weights become 1 + NORM_JITTER * N(0, 1)
GREEDY_PROMPT = "The keeper writes down the level every hour:"
# seed search (make_model_fixtures.py): try seed, seed+17, ... until all of these hold
SEED_ATTEMPTS = 12
MIN_ROUTER_MARGIN = 2e-4  # k-th vs (k+1)-th expert score, every token of every case
MIN_LOGIT_MARGIN = 5e-4  # top-1 vs top-2 logit, every position of every case
MIN_GREEDY_MARGIN = 2e-3  # top-1 vs top-2 logit at every greedy step
MIN_GREEDY_DISTINCT = 6  # distinct tokens among the 16 greedy ones

# byte-level BPE pre-tokenizer regex of Qwen2 / Qwen3 (llama.cpp pre-tokenizer name "qwen2")
QWEN2_PRETOKENIZER_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA_CPP_PRE_NAME = "qwen2"

DEEPSEEK_TOOL_TOKENS = [
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
    "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
    "<｜tool▁sep｜>",
]

FAMILIES = {
    "qwen3_moe": {
        "architecture": "Qwen3MoeForCausalLM",
        "config_class": "Qwen3MoeConfig",
        "seed": 1001,
        "config": dict(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
            max_position_embeddings=512, initializer_range=0.05, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            attention_bias=False, decoder_sparse_step=1, mlp_only_layers=[],
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
            tie_word_embeddings=False, use_sliding_window=False,
        ),
        "tokenizer": {
            "leading_special": [],
            "trailing_special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            "trailing_added": ["<think>", "</think>"],  # added, not special (as in Qwen3)
            "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>", "unk": None,
            "add_bos": False,
            "config_bos": "<|endoftext|>", "config_eos": "<|im_end|>",
            "generation_eos": ["<|im_end|>", "<|endoftext|>"],
        },
        "chat_template": "Qwen-Qwen3-0.6B.jinja",
    },
    "mixtral": {
        "architecture": "MixtralForCausalLM",
        "config_class": "MixtralConfig",
        "seed": 1002,
        "config": dict(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
            max_position_embeddings=512, initializer_range=0.05, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            sliding_window=None, num_local_experts=8, num_experts_per_tok=2,
            router_jitter_noise=0.0, tie_word_embeddings=False,
        ),
        "tokenizer": {
            "leading_special": ["<unk>", "<s>", "</s>"],
            "trailing_special": [],
            "trailing_added": [],
            "bos": "<s>", "eos": "</s>", "pad": None, "unk": "<unk>",
            "add_bos": True,
            "config_bos": "<s>", "config_eos": "</s>",
            "generation_eos": ["</s>"],
        },
        "chat_template": "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    },
    "olmoe": {
        "architecture": "OlmoeForCausalLM",
        "config_class": "OlmoeConfig",
        "seed": 1003,
        # tied lm_head: with full-size random embeddings the current token's own logit dominates
        # and greedy decoding repeats one token forever; a smaller embedding avoids that
        "embed_scale": 0.4,
        "config": dict(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, hidden_act="silu",
            max_position_embeddings=512, initializer_range=0.05, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            attention_bias=False, clip_qkv=None, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=False, tie_word_embeddings=True,
        ),
        "tokenizer": {
            "leading_special": [],
            "trailing_special": ["<|endoftext|>", "<|padding|>", "<|begin_of_text|>",
                                 "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                                 "<|eom_id|>", "<|python_tag|>"],
            "trailing_added": [],
            "bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "pad": "<|padding|>", "unk": None,
            "add_bos": False,
            "config_bos": "<|begin_of_text|>", "config_eos": "<|eot_id|>", "config_pad": "<|padding|>",
            "generation_eos": ["<|eot_id|>", "<|endoftext|>"],
        },
        "chat_template": "meta-llama-Llama-3.1-8B-Instruct.jinja",
    },
    "deepseek_v3": {
        "architecture": "DeepseekV3ForCausalLM",
        "config_class": "DeepseekV3Config",
        "seed": 1004,
        "mtp": True,
        "config": dict(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.5,
            kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32,
            n_group=4, topk_group=2, first_k_dense_replace=1, norm_topk_prob=True,
            hidden_act="silu", max_position_embeddings=512, initializer_range=0.05, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 128, "beta_fast": 32.0,
                             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
            rope_interleave=True, attention_bias=False, tie_word_embeddings=False,
            num_nextn_predict_layers=1,
            # fields of the real DeepSeek-V3 config.json that transformers keeps as extras;
            # llama.cpp's converter reads scoring_func for the gating function
            scoring_func="sigmoid", topk_method="noaux_tc",
        ),
        "tokenizer": {
            "leading_special": ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"],
            "trailing_special": ["<｜User｜>", "<｜Assistant｜>"] + DEEPSEEK_TOOL_TOKENS,
            "trailing_added": ["<think>", "</think>"],
            "bos": "<｜begin▁of▁sentence｜>", "eos": "<｜end▁of▁sentence｜>", "pad": "<｜▁pad▁｜>",
            "unk": None, "add_bos": True,
            "config_bos": "<｜begin▁of▁sentence｜>", "config_eos": "<｜end▁of▁sentence｜>",
            "generation_eos": ["<｜end▁of▁sentence｜>"],
        },
        "chat_template": "deepseek-ai-DeepSeek-V3.1.jinja",
    },
    "glm4_moe": {
        "architecture": "Glm4MoeForCausalLM",
        "config_class": "Glm4MoeConfig",
        "seed": 1005,
        "mtp": True,
        "config": dict(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            hidden_act="silu", max_position_embeddings=512, initializer_range=0.05, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                             "partial_rotary_factor": 0.5},
            partial_rotary_factor=0.5,
            attention_bias=True, use_qk_norm=True,
            n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.5,
            n_group=2, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
            tie_word_embeddings=False, num_nextn_predict_layers=1,
        ),
        "tokenizer": {
            "leading_special": [],
            "trailing_special": ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
                                 "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
                                 "<think>", "</think>", "<tool_call>", "</tool_call>",
                                 "<tool_response>", "</tool_response>", "<arg_key>", "</arg_key>",
                                 "<arg_value>", "</arg_value>"],
            "trailing_added": [],
            "bos": None, "eos": "<|endoftext|>", "pad": "<|endoftext|>", "unk": None,
            "add_bos": False,
            "config_bos": None, "config_eos": ["<|endoftext|>", "<|user|>", "<|observation|>"],
            "config_pad": "<|endoftext|>",
            "generation_eos": ["<|endoftext|>", "<|user|>", "<|observation|>"],
        },
        "chat_template": "GLM-4.6.jinja",
    },
}
