"""A transformers checkpoint's config.json as our model config: pure config mapping, no torch (docs/hf.md).

    read_hf_config(DIR) -> (family, config.json)   Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE, or one line refusing
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
                 "Qwen3MoeForCausalLM": "qwen3_moe", "OlmoeForCausalLM": "olmoe"}
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


def _rope(hf: dict) -> tuple[float, str]:
    """(theta, rope type) from transformers 5's rope_parameters or 4.x's rope_theta + rope_scaling."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    return float(theta), params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"


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
         "shared_expert_intermediate_size": 0}
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
    theta, rope_type = _rope(hf)
    refuse(rope_type != "default", f"rope_type={rope_type!r} (rope scaling)")
    refuse(hf.get("hidden_act", "silu") != "silu", f"hidden_act={hf.get('hidden_act')!r}")
    refuse(bool(hf.get("sliding_window")) and hf.get("use_sliding_window", True),
           f"sliding_window={hf.get('sliding_window')}")
    out = dict(vocab_size=hf["vocab_size"], d_model=D, n_layers=L, n_heads=H,
               n_kv_heads=hf.get("num_key_value_heads") or H, head_dim=hf.get("head_dim") or D // H,
               top_k=hf["num_experts_per_tok"], pos_emb="rope", rope_theta=theta,
               max_seq_len=hf["max_position_embeddings"], norm_eps=hf["rms_norm_eps"],
               moe_every=1, first_k_dense=0, dense_layers=[], dense_ffn_dim=0, qk_norm="none", attn_bias=False,
               shared_experts=0, shared_ffn_dim=0, shared_expert_gate=False, norm_topk=True,
               router_score="softmax", routed_scale=1.0)  # the four families' router
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
