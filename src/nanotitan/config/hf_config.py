"""A transformers checkpoint's config.json as our model config: pure config mapping, no torch (docs/hf.md).

    read_hf_config(DIR) -> (family, config.json)   Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE or DeepSeek-V3, or one line
                                                   refusing
    config_from_hf(DIR) -> {model key: value}      the model config a checkpoint implies
    apply_init_config(cfg)                         init.from_hf: model keys and tokenizer path from DIR

resolve.py applies it once per job; hf.py (weights in and out) reads the family from here. The reverse
mapping (our config -> config.json, for export) needs the model's derived sizes, so it stays in hf.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from .config import Config, ConfigError, ModelConfig, validate
from .errors import first_line

ARCHITECTURES = {"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                 "Qwen3MoeForCausalLM": "qwen3_moe", "OlmoeForCausalLM": "olmoe",
                 "DeepseekV3ForCausalLM": "deepseek_v3"}  # also Kimi-K2 (model_type kimi_k2) and Moonlight
FAMILY_ARCH = {f: a for a, f in ARCHITECTURES.items()}


def read_hf_config(hf_dir: str | Path) -> tuple[str, dict]:
    """(family, config.json as a dict); fails in one line for a missing file or another architecture."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"init.from_hf={str(hf_dir)!r} has no config.json (a directory written by "
                          "transformers' save_pretrained or `nanotitan export`)")
    try:
        hf = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
        raise ConfigError(f"init.from_hf={str(hf_dir)!r}: config.json is not readable JSON ({first_line(e)})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"init.from_hf={str(hf_dir)!r}: config.json holds a {type(hf).__name__}, not an object")
    archs = hf.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        archs = [str(archs)]
    family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if family is None and hf.get("model_type") in FAMILY_ARCH:
        family = hf["model_type"]
    if family is None:
        raise ConfigError(f"init.from_hf={str(hf_dir)!r}: architecture {archs or hf.get('model_type')} is not "
                          f"supported (supported: {', '.join(ARCHITECTURES)})")
    return family, hf


def _rope(hf: dict) -> tuple[float, str, dict]:
    """(theta, rope type, its parameters) from transformers 5's rope_parameters or 4.x's rope_theta + rope_scaling."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    return float(theta), params.get("rope_type") or params.get("type") or "default", params


def _yarn_keys(refuse, rope_type: str, p: dict) -> dict:
    """Our rope_* keys for rope type default or yarn (transformers' _compute_yarn_parameters); anything else fails."""
    refuse(rope_type not in ("default", "yarn"), f"rope_type={rope_type!r} (only yarn scaling is supported)")
    if rope_type == "default":
        return dict(rope_scaling="none", rope_factor=1.0, rope_original_max_len=0, rope_beta_fast=32.0,
                    rope_beta_slow=1.0, rope_mscale=1.0, rope_mscale_all_dim=0.0)
    refuse(p.get("attention_factor") is not None, f"yarn attention_factor={p.get('attention_factor')}")
    refuse(p.get("truncate", True) is not True, "yarn truncate=false")
    refuse(p.get("partial_rotary_factor", 1.0) != 1.0, f"partial_rotary_factor={p.get('partial_rotary_factor')}")
    refuse(not isinstance(p.get("factor"), (int, float)) or p["factor"] < 1, f"yarn factor={p.get('factor')!r}")
    # transformers: mscale/mscale_all_dim matter only when both are set (else mscale(factor)); 0 stands for unset
    return dict(rope_scaling="yarn", rope_factor=float(p["factor"]),
                rope_original_max_len=int(p["original_max_position_embeddings"]),
                rope_beta_fast=float(p.get("beta_fast") or 32), rope_beta_slow=float(p.get("beta_slow") or 1),
                rope_mscale=float(p.get("mscale") or 0.0), rope_mscale_all_dim=float(p.get("mscale_all_dim") or 0.0))


def config_from_hf(hf_dir: str | Path) -> dict:
    """{ModelConfig key: value} for every architecture key, from DIR's config.json. Anything our model cannot
    compute exactly (rope scaling, sliding windows, clipped qkv, ...) fails in one line naming it."""
    family, hf = read_hf_config(hf_dir)
    try:
        _check_numbers(hf_dir, hf)
        return _model_keys(hf_dir, family, hf)
    except KeyError as e:
        raise ConfigError(f"init.from_hf={str(hf_dir)!r}: config.json has no {e.args[0]!r}, which "
                          f"{FAMILY_ARCH[family]} needs") from None
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError) as e:  # a value of another type than transformers writes
        raise ConfigError(f"init.from_hf={str(hf_dir)!r}: config.json holds a value {FAMILY_ARCH[family]} cannot "
                          f"take ({first_line(e)})") from None


# config.json's sizes (those present; _model_keys names a missing one) and the least each may be.
SIZES = {"hidden_size": 1, "num_attention_heads": 1, "num_hidden_layers": 1, "num_key_value_heads": 0, "head_dim": 0,
         "num_experts_per_tok": 1, "max_position_embeddings": 1, "vocab_size": 1, "intermediate_size": 1,
         "moe_intermediate_size": 1, "num_local_experts": 1, "num_experts": 1, "decoder_sparse_step": 1,
         "shared_expert_intermediate_size": 0, "n_routed_experts": 1, "n_shared_experts": 0, "n_group": 1,
         "topk_group": 1, "first_k_dense_replace": 0, "q_lora_rank": 0, "kv_lora_rank": 1, "qk_nope_head_dim": 0,
         "qk_rope_head_dim": 2, "v_head_dim": 1}
POSITIVE = ("rms_norm_eps", "rope_theta")  # numbers, finite and > 0


def _check_numbers(hf_dir, hf: dict) -> None:
    """Every size config.json gives is an integer at least its floor, every scale a finite number > 0: one line
    naming the key (a huge size is the memory check's, fits.py, which says how many GiB it would take)."""
    at = f"init.from_hf={str(hf_dir)!r}: config.json's"
    for key, least in SIZES.items():
        v = hf.get(key)
        if v is None and (least == 0 or key not in ("hidden_size", "num_attention_heads", "num_hidden_layers")):
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise ConfigError(f"{at} {key}={v!r} must be an integer >= {least}")
    for key in POSITIVE:
        v = hf.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf")):
            raise ConfigError(f"{at} {key}={v!r} must be a finite number > 0")
    only = hf.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ConfigError(f"{at} mlp_only_layers={only!r} must be a list of layer indices")


def _model_keys(hf_dir, family: str, hf: dict) -> dict:
    def refuse(bad: bool, what: str) -> None:
        if bad:
            raise ConfigError(f"init.from_hf={str(hf_dir)!r}: {FAMILY_ARCH[family]} with {what} is not supported")

    D, H, L = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    theta, rope_type, rope_params = _rope(hf)
    refuse(hf.get("hidden_act", "silu") != "silu", f"hidden_act={hf.get('hidden_act')!r}")
    refuse(bool(hf.get("sliding_window")) and hf.get("use_sliding_window", True),
           f"sliding_window={hf.get('sliding_window')}")
    out = dict(vocab_size=hf["vocab_size"], d_model=D, n_layers=L, n_heads=H,
               n_kv_heads=hf.get("num_key_value_heads") or H, head_dim=hf.get("head_dim") or D // H,
               top_k=hf["num_experts_per_tok"], pos_emb="rope", rope_theta=theta,
               max_seq_len=hf["max_position_embeddings"], norm_eps=hf["rms_norm_eps"],
               moe_every=1, first_k_dense=0, dense_layers=[], dense_ffn_dim=0, qk_norm="none", attn_bias=False,
               shared_experts=0, shared_ffn_dim=0, shared_expert_gate=False, norm_topk=True,
               router_score="softmax", routed_scale=1.0,  # the four families' router
               q_lora_rank=0, kv_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0, v_head_dim=0, n_group=1,
               topk_group=1, **_yarn_keys(refuse, rope_type, rope_params))
    if family == "deepseek_v3":
        return {**out, **_deepseek_keys(refuse, hf), "mtp_layers": stored_mtp_layers(hf_dir, hf)}
    # transformers renames the expert count per family and per version (attribute_map): read either.
    out["num_experts"] = hf["num_local_experts"] if "num_local_experts" in hf else hf["num_experts"]
    if family == "mixtral":
        out.update(ffn_dim=hf["intermediate_size"])
    elif family in ("qwen2_moe", "qwen3_moe"):
        step, only = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
        dense = [i for i in range(L) if i in only or (i + 1) % step != 0]  # HF: MoE iff not the above
        out.update(ffn_dim=hf["moe_intermediate_size"], dense_layers=dense,
                   dense_ffn_dim=hf["intermediate_size"] if dense else 0, norm_topk=hf.get("norm_topk_prob", False))
        if family == "qwen2_moe":
            shared = hf.get("shared_expert_intermediate_size", 0)
            out.update(attn_bias=hf.get("qkv_bias", True), shared_experts=1 if shared else 0,
                       shared_ffn_dim=shared, shared_expert_gate=bool(shared))
        else:
            refuse(hf.get("attention_bias", False), "attention_bias=true (a bias on o_proj too)")
            out.update(qk_norm="head")
    else:  # olmoe
        refuse(hf.get("clip_qkv") is not None, f"clip_qkv={hf.get('clip_qkv')}")
        refuse(hf.get("attention_bias", False), "attention_bias=true (a bias on o_proj too)")
        refuse(out["head_dim"] * H != D, f"head_dim={out['head_dim']} != hidden_size/num_attention_heads")
        out.update(ffn_dim=hf["intermediate_size"], qk_norm="full",
                   norm_topk=hf.get("norm_topk_prob", False))
    return out


def _deepseek_keys(refuse, hf: dict) -> dict:
    """DeepseekV3ForCausalLM (and configs that build its modules: Kimi-K2, Moonlight; DeepSeek-V2-Lite's shape
    with q_lora_rank null): MLA, first_k_dense_replace dense layers, sigmoid routing with the selection bias
    (e_score_correction_bias: our router_bias, so the aux-free update is on at DeepSeek-V3's rate 0.001 unless
    the user sets another), group-limited top-k, shared experts. MTP: `stored_mtp_layers`."""
    H = hf["num_attention_heads"]
    refuse(hf.get("scoring_func", "sigmoid") != "sigmoid", f"scoring_func={hf.get('scoring_func')!r}")
    refuse(hf.get("topk_method", "noaux_tc") != "noaux_tc", f"topk_method={hf.get('topk_method')!r}")
    refuse(not hf.get("n_shared_experts", 1), "n_shared_experts=0")
    refuse(hf.get("moe_layer_freq", 1) != 1, f"moe_layer_freq={hf.get('moe_layer_freq')}")
    refuse(hf.get("quantization_config") is not None, "quantization_config (FP8 blocks: dequantize to bf16 first)")
    refuse((hf.get("num_key_value_heads") or H) != H, f"num_key_value_heads={hf.get('num_key_value_heads')} "
           "!= num_attention_heads (MLA's heads all read the latent)")
    F = hf["moe_intermediate_size"]
    return dict(num_experts=hf["n_routed_experts"], n_kv_heads=0, head_dim=0, q_lora_rank=hf.get("q_lora_rank") or 0,
                kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
                qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"], ffn_dim=F,
                first_k_dense=hf.get("first_k_dense_replace", 3), dense_ffn_dim=hf["intermediate_size"],
                shared_experts=hf.get("n_shared_experts", 1), shared_ffn_dim=F, router_score="sigmoid",
                routed_scale=float(hf.get("routed_scaling_factor", 2.5)), norm_topk=hf.get("norm_topk_prob", True),
                n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
                attn_bias=hf.get("attention_bias", False), bias_update_rate=BIAS_RATE)


def stored_mtp_layers(hf_dir: str | Path, hf: dict) -> int:
    """model.mtp_layers of a DeepSeek-V3 dir: num_nextn_predict_layers when DIR holds those layers' weights
    (DeepSeek's own checkpoints, our exports: layers numbered from num_hidden_layers on, model/mtp.py), else 0:
    transformers' class has no MTP modules and its saves hold none, though its config says 1."""
    n = hf.get("num_nextn_predict_layers") or 0
    if not isinstance(n, int) or n <= 0:
        return 0
    first = f"model.layers.{hf['num_hidden_layers']}."
    return n if any(k.startswith(first) for k in _weight_names(Path(hf_dir).expanduser())) else 0


def _weight_names(hf_dir: Path) -> list[str]:
    """The tensor names of DIR's safetensors (the index's weight map, or the single file's header: no tensor is
    read, nothing is unpickled); [] when neither is readable (the weight loader names that failure)."""
    try:
        index = hf_dir / "model.safetensors.index.json"
        if index.is_file():
            return list(json.loads(index.read_bytes())["weight_map"])
        with open(hf_dir / "model.safetensors", "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            return [k for k in json.loads(f.read(min(n, 2**27))) if k != "__metadata__"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


BIAS_RATE = 1e-3  # DeepSeek-V3's bias update speed (gamma, §2.1.2); any rate > 0 the user sets is kept


def apply_init_config(cfg: Config, need_tokenizer: bool = True) -> None:
    """init.from_hf: the model config comes from DIR's config.json and the tokenizer is DIR's tokenizer.json
    (data.tokenizer), so data preparation encodes with it; a DIR without one needs data.tokenizer, unless
    `need_tokenizer` is False (`hf.load_pretrained`: the weights only, as transformers' from_pretrained). A model
    key the user set (cfg.explicit, from load_config; for a Config built in code, every key that differs from its
    default) to another value fails in one line."""
    hf_dir = Path(cfg.init.from_hf).expanduser()
    default = ModelConfig()
    for key, value in config_from_hf(hf_dir).items():
        mine = getattr(cfg.model, key)
        was_set = f"model.{key}" in cfg.explicit if cfg.explicit is not None else mine != getattr(default, key)
        if key == "bias_update_rate" and was_set and mine > 0:  # a training rate: the user's, while the bias exists
            continue
        if was_set and mine != value:
            raise ConfigError(f"model.{key}={mine} conflicts with init.from_hf={str(hf_dir)!r}, whose config.json "
                              f"gives {value} (drop --model.{key})")
        setattr(cfg.model, key, value)
    tok = hf_dir / "tokenizer.json"
    if not tok.is_file():
        if cfg.data.tokenizer or not need_tokenizer:  # the given one (or none: weights only)
            return
        raise ConfigError(f"init.from_hf={str(hf_dir)!r} has no tokenizer.json (save the model's fast tokenizer "
                          "there: tokenizer.save_pretrained(DIR), or give one with --data.tokenizer FILE)")
    if cfg.data.tokenizer and Path(cfg.data.tokenizer).expanduser().resolve() != tok.resolve():
        raise ConfigError(f"data.tokenizer={cfg.data.tokenizer!r} conflicts with init.from_hf, whose tokenizer is "
                          f"{tok} (drop --data.tokenizer)")
    cfg.data.tokenizer = str(tok.resolve())


def resolve_model(cfg: Config) -> Config:
    """A copy of cfg whose model and data keys are concrete (init.from_hf's model and tokenizer,
    model.vocab_size); the layout stays as written. What `nanotitan plan`, `bench layouts` and `data prepare`
    need; resolve() (nanotitan/resolve.py) starts with it."""
    if cfg.resolved:
        return cfg
    c = copy.deepcopy(cfg)
    if c.init.from_hf:
        apply_init_config(c)
    if c.model.vocab_size == 0:
        c.model.vocab_size = c.data.vocab_size
    if c.init.from_hf:
        validate(c)  # load_config could not: the model keys were init.from_hf's, unknown until now
    return c
