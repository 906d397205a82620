"""Hugging Face interop: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and DeepSeek-V3 checkpoints in and out (docs/hf.md).

    config_from_hf(DIR) -> {model key: value}      the model config a transformers checkpoint implies
                                                   (config/hf_config.py)
    apply_init_config(cfg)                         init.from_hf: model config and tokenizer from DIR
                                                   (config/hf_config.py)
    load_into_shard(model, DIR)                    this shard's slice only: its layers, its experts
    load_pretrained(DIR) -> (Config, Transformer)  one process, eval-ready
    save_pretrained(model, cfg, DIR, dtype=...)    config.json + model.safetensors (+ shards and index)
    export_checkpoint(run_dir, out, ...)           `nanotitan export`: a DCP checkpoint of any layout -> DIR

Names: our layer keys are global indices like HF's, so one regex table maps every non-expert tensor.
Experts are stacked here as W_gate, W_val [E, D, F] and W_out [E, F, D] (used as x @ W): transposes of
HF's per-expert nn.Linear weights, gate/up [F, D] and down [D, F]. On disk, transformers keeps one tensor
per expert (5.x fuses them into gate_up_proj [E, 2F, D] / down_proj [E, D, F] in memory and saves the
per-expert form by default); both forms are read, the per-expert one is written. DeepSeek-V3's router
bias (`mlp.gate.e_score_correction_bias`) is our `router_bias` buffer, and its rotary rows are permuted
between its interleaved layout and our rotate_half one (`rope_rows`).

Reads are lazy: `safe_open(...).get_slice(name)` of only the tensors (and expert rows, and TP slices) a shard
owns, so a rank never reads, or holds, the whole checkpoint (nor, under TP, a whole split tensor). transformers
itself is not needed at run time.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..config.config import Config, ConfigError, ModelConfig, load_config, validate
from ..config.errors import CheckpointError, first_line
from ..config.fits import does_not_fit
from ..config.hf_config import (ARCHITECTURES, FAMILY_ARCH, apply_init_config, config_from_hf,  # noqa: F401
                                read_hf_config)  # noqa: F401
from ..model.spec import ModelShardSpec
from ..model.transformer import Transformer, head_dim, is_moe_layer, kv_heads, shared_hidden
from ..parallel.tp import tp_part
from .deepseek import DEEPSEEK_RULES, deepseek_config, ignored_key, mtp_shared_copies, rope_parameters, rope_rows

DTYPES = {"fp32": (torch.float32, "float32"), "bf16": (torch.bfloat16, "bfloat16")}
MAX_SHARD_BYTES = 5 * 2**30  # transformers' default shard size: larger exports are split (+ index)
EXPERT_WEIGHTS = ("W_gate", "W_val", "W_out")  # ours, in the order of HF's (gate, up, down)
_EXPERT = re.compile(r"layers\.([0-9]+)\.moe\.experts\.(W_gate|W_val|W_out)")  # fullmatch


def _moe_block(family: str) -> str:
    return "block_sparse_moe" if family == "mixtral" else "mlp"


def hf_name(family: str, name: str) -> str:
    """Our (non-expert) parameter name -> the tensor name in the family's checkpoint."""
    rules = [*(DEEPSEEK_RULES if family == "deepseek_v3" else []),
             (r"^tok_emb\.", "model.embed_tokens."), (r"^norm\.", "model.norm."), (r"^head\.", "lm_head."),
             (r"^layers\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
             (r"^layers\.(\d+)\.ffn_norm\.", r"model.layers.\1.post_attention_layernorm."),
             (r"^layers\.(\d+)\.attn\.", r"model.layers.\1.self_attn."),
             (r"^layers\.(\d+)\.mlp\.", r"model.layers.\1.mlp."),  # dense layers (Qwen's mlp_only_layers)
             (r"^layers\.(\d+)\.moe\.router\.", rf"model.layers.\1.{_moe_block(family)}.gate."),
             (r"^layers\.(\d+)\.moe\.shared_expert", r"model.layers.\1.mlp.shared_expert")]  # and its _gate
    for pattern, repl in rules:
        out, n = re.subn(pattern, repl, name)
        if n:
            return out
    raise AssertionError(f"no Hugging Face name for parameter {name}")


def hf_expert_name(family: str, layer: int, expert: int, which: int) -> str:
    """HF name of expert `expert`'s gate (which=0), up (1) or down (2) projection in layer `layer`."""
    proj = ("w1", "w3", "w2")[which] if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")[which]
    return f"model.layers.{layer}.{_moe_block(family)}.experts.{expert}.{proj}.weight"


# --- config out ---------------------------------------------------------------------------------

def hf_config(m: ModelConfig, eos_token_id: int | None = None, dtype: str = "fp32") -> dict:
    """Our model config -> config.json of the one family that computes the same function; an option no
    supported transformers class can represent fails in one line naming it."""
    def refuse(bad: bool, option: str, why: str) -> None:
        if bad:
            raise ConfigError(f"cannot export {option}: {why} (supported: {', '.join(ARCHITECTURES)}; docs/hf.md)")

    refuse(m.pos_emb != "rope", "model.pos_emb=learned", "every supported family uses rotary embeddings")
    dense = [i for i in range(m.n_layers) if not is_moe_layer(m, i)]
    common = dict(vocab_size=m.vocab_size, hidden_size=m.d_model, num_hidden_layers=m.n_layers,
                  num_attention_heads=m.n_heads, hidden_act="silu", max_position_embeddings=m.max_seq_len,
                  rms_norm_eps=m.norm_eps, rope_parameters=rope_parameters(m),
                  rope_theta=m.rope_theta,  # transformers 4.x reads this one
                  num_experts_per_tok=m.top_k, tie_word_embeddings=False, initializer_range=m.init_std,
                  bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=None, use_cache=True,
                  dtype=DTYPES[dtype][1], torch_dtype=DTYPES[dtype][1], attention_dropout=0.0,
                  router_aux_loss_coef=m.aux_coef, output_router_logits=False)
    if m.kv_lora_rank:
        return deepseek_config(m, common, dense, refuse)
    only_ds = "only DeepseekV3ForCausalLM has it, and that needs MLA (model.kv_lora_rank > 0)"
    refuse(m.router_score != "softmax", f"model.router_score={m.router_score}", only_ds)
    refuse(m.routed_scale != 1.0, f"model.routed_scale={m.routed_scale}", only_ds)
    refuse(m.bias_update_rate > 0, f"model.bias_update_rate={m.bias_update_rate} (the aux-loss-free bias)", only_ds)
    refuse(m.n_group > 1, f"model.n_group={m.n_group} (group-limited routing)", only_ds)
    if m.qk_norm == "full":
        family = "olmoe"
    elif m.qk_norm == "head":
        family = "qwen3_moe"
    elif m.shared_experts or m.attn_bias:
        family = "qwen2_moe"
    else:
        family = "mixtral"
    arch = FAMILY_ARCH[family]
    refuse(family == "mixtral" and not m.norm_topk, "model.norm_topk=false",
           "without q/k norms or shared experts the model is a Mixtral, which always renormalises the top-k")
    refuse(family in ("mixtral", "olmoe") and bool(dense), f"dense layers {dense} (moe_every/first_k_dense/"
           "dense_layers)", f"{arch} has an MoE FFN in every layer (Qwen's mlp_only_layers can: use qk_norm=head)")
    refuse(family != "qwen2_moe" and bool(m.shared_experts), f"model.shared_experts with qk_norm={m.qk_norm}",
           "only Qwen2MoeForCausalLM has a shared expert, and it has no q/k norm")
    refuse(family != "qwen2_moe" and m.attn_bias, f"model.attn_bias with qk_norm={m.qk_norm}",
           f"{arch}'s attention_bias also puts a bias on o_proj")
    refuse(family == "qwen2_moe" and not m.shared_experts, "model.attn_bias without model.shared_experts",
           "only Qwen2MoeForCausalLM has q/k/v biases, and it always has a shared expert")
    refuse(family == "qwen2_moe" and not m.shared_expert_gate, "model.shared_expert_gate=false",
           "Qwen2MoeForCausalLM always gates its shared expert with a sigmoid")
    refuse(family == "olmoe" and head_dim(m) * m.n_heads != m.d_model, f"model.head_dim={m.head_dim} with qk_norm=full",
           "OlmoeForCausalLM's q_norm is hidden_size wide")
    out = dict(architectures=[arch], model_type=family, **common, num_key_value_heads=kv_heads(m),
               head_dim=head_dim(m))
    if family == "mixtral":
        out.update(intermediate_size=m.ffn_dim, num_local_experts=m.num_experts, sliding_window=None,
                   router_jitter_noise=0.0)
    elif family in ("qwen2_moe", "qwen3_moe"):
        out.update(intermediate_size=m.dense_ffn_dim or m.ffn_dim, moe_intermediate_size=m.ffn_dim,
                   num_experts=m.num_experts, norm_topk_prob=m.norm_topk, decoder_sparse_step=1,
                   mlp_only_layers=dense, use_sliding_window=False, sliding_window=None)
        if family == "qwen2_moe":
            out.update(qkv_bias=m.attn_bias, shared_expert_intermediate_size=shared_hidden(m))
        else:
            out.update(attention_bias=False)
    else:
        out.update(intermediate_size=m.ffn_dim, num_experts=m.num_experts, norm_topk_prob=m.norm_topk,
                   clip_qkv=None, attention_bias=False)
    return out


# --- weights in ---------------------------------------------------------------------------------

class _Reader(contextlib.ExitStack):
    """Lazy tensor reads from a checkpoint dir (one file or an index of shards): a file is opened (mmap) on
    first use and only the requested tensor, or rows of it, is read."""

    def __init__(self, hf_dir: Path):
        super().__init__()
        self.hf_dir = hf_dir
        self.files: dict[Path, object] = {}  # opened (mmap) on first use
        self.read: set[str] = set()
        index, single = hf_dir / "model.safetensors.index.json", hf_dir / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_bytes())["weight_map"]
                self.file_of = {k: hf_dir / Path(f).name for k, f in weight_map.items() if isinstance(f, str)}
                assert all(isinstance(k, str) for k in weight_map) and len(self.file_of) == len(weight_map)
            except (OSError, ValueError, KeyError, TypeError, AttributeError, AssertionError) as e:
                raise ConfigError(f"init.from_hf={str(hf_dir)!r}: {index.name} is not a weight map of tensor "
                                  f"names to files ({first_line(e)})") from None
        elif single.is_file():
            self.files[single] = self._open(single)
            self.file_of = {k: single for k in self.files[single].keys()}
        else:
            raise ConfigError(f"init.from_hf={str(hf_dir)!r} has neither model.safetensors nor "
                              "model.safetensors.index.json (PyTorch .bin checkpoints: re-save with safetensors)")

    def has(self, key: str) -> bool:
        return key in self.file_of

    def get(self, key: str, index: tuple[slice, ...] = ()) -> torch.Tensor:
        """Tensor `key`, or only its part `index` (a slice per leading dim: expert rows, a TP slice)."""
        if key not in self.file_of:
            raise ConfigError(f"init.from_hf={str(self.hf_dir)!r} has no tensor {key!r} that the model needs "
                              "(its config.json and weights disagree)")
        path = self.file_of[key]
        if path not in self.files:
            self.files[path] = self._open(path)
        self.read.add(key)
        try:
            sl = self.files[path].get_slice(key)
            t = sl[index] if index else sl[:]
        except (SafetensorError, OSError, ValueError) as e:
            raise ConfigError(f"init.from_hf={str(self.hf_dir)!r}: tensor {key!r} of {path.name} cannot be read "
                              f"({first_line(e)})") from None
        if not t.is_floating_point():  # copy_ would convert integers silently into weights
            raise ConfigError(f"init.from_hf={str(self.hf_dir)!r}: tensor {key!r} of {path.name} is {t.dtype}, "
                              "not a floating-point weight (a damaged or foreign file)")
        return t

    def _open(self, path: Path):
        """safe_open, or one line naming the file: missing, truncated, or not safetensors at all."""
        try:
            return self.enter_context(safe_open(path, framework="pt"))
        except (SafetensorError, OSError, ValueError) as e:
            raise ConfigError(f"init.from_hf={str(self.hf_dir)!r}: {path.name} is not a readable safetensors file "
                              f"({first_line(e)}; truncated or damaged? re-save or re-download it)") from None


def _copy(p: torch.Tensor, t: torch.Tensor, key: str, name: str) -> None:
    if tuple(t.shape) != tuple(p.shape):
        raise ConfigError(f"tensor {key!r} has shape {list(t.shape)} but model {name} needs {list(p.shape)} "
                          "(the model config differs from init.from_hf's config.json)")
    p.copy_(t)


def _load_experts(r: _Reader, family: str, layer: int, which: int, p: torch.Tensor, e0: int, name: str) -> None:
    """Rows [e0, e0 + L) of one stacked expert weight: per-expert tensors, or transformers-5 fused ones."""
    L = p.shape[0]
    if r.has(hf_expert_name(family, layer, e0, which)):
        for l in range(L):
            key = hf_expert_name(family, layer, e0 + l, which)
            _copy(p[l], r.get(key).T, key, f"{name}[{l}]")
        return
    base = f"model.layers.{layer}.mlp.experts."
    if which == 2:  # down_proj (E, D, F)
        _copy(p, r.get(base + "down_proj", (slice(e0, e0 + L),)).transpose(1, 2), base + "down_proj", name)
    else:  # gate_up_proj (E, 2F, D): gate rows, then up rows
        gate_up = r.get(base + "gate_up_proj", (slice(e0, e0 + L),))
        Fh = gate_up.shape[1] // 2
        _copy(p, gate_up[:, which * Fh:(which + 1) * Fh].transpose(1, 2), base + "gate_up_proj", name)


def _part(p: torch.Tensor) -> tuple[slice, ...]:
    """The index of p in its whole tensor: () for a whole one, its rows or columns for a TP slice."""
    part = tp_part(p)
    if part is None:
        return ()
    dim, rank, _ = part
    return (slice(None),) * dim + (slice(rank * p.shape[dim], (rank + 1) * p.shape[dim]),)


def shard_loader(cfg: Config):
    """What `parallelize` calls on each model chunk to fill it from init.from_hf (None without one): the caller
    hands it down, so parallel/ never imports interop/."""
    if not cfg.init.from_hf:
        return None
    return lambda chunk: load_into_shard(chunk, cfg.init.from_hf)


@torch.no_grad()
def load_into_shard(model: Transformer, hf_dir: str | Path) -> list[str]:
    """Load this shard's slice of DIR's weights into `model` (built from the config apply_init_config
    made): only the tensors of its layers and embeddings, only its experts' rows, and of a TP-sliced parameter
    (parallel/tp.py: `tp_part`) only its slice, are read. For the full model, a checkpoint tensor that nothing
    reads is an error (config and weights disagree).
    Returns the names of the checkpoint tensors it read."""
    hf_dir = Path(hf_dir).expanduser()
    family, conf = read_hf_config(hf_dir)
    interleaved = family == "deepseek_v3" and conf.get("rope_interleave", True)
    e0 = model.spec.expert_start
    with _Reader(hf_dir) as r:
        for name, p in _weights(model, family):
            m = _EXPERT.fullmatch(name)
            if m:  # the shard's experts [e0, expert_end) in its first slots; a placement's spare slots stay empty
                n = model.spec.expert_end - e0
                _load_experts(r, family, int(m[1]), EXPERT_WEIGHTS.index(m[2]), p[:n], e0, name)
                p[n:].zero_()
                continue
            key = hf_name(family, name)
            if key == "lm_head.weight" and not r.has(key):
                key = "model.embed_tokens.weight"  # tie_word_embeddings: our head starts as a copy
            _copy(p, r.get(key, _part(p)), key, name)
            if interleaved:  # per head: a TP slice holds whole heads
                p.copy_(rope_rows(model.cfg, name, p.clone(), to_hf=False))
        if family == "deepseek_v3" and model.spec.mtp_layers:
            _check_mtp_copies(r, model, hf_dir)
        if model.spec == ModelShardSpec.full(model.cfg):
            unused = sorted(k for k in set(r.file_of) - r.read if not ignored_key(model.cfg, k))
            if unused:
                raise ConfigError(f"init.from_hf={str(hf_dir)!r}: {len(unused)} tensors the model does not use, "
                                  f"e.g. {unused[0]!r} (its config.json and weights disagree)")
        return sorted(r.read)


def _check_mtp_copies(r: _Reader, model: Transformer, hf_dir: Path) -> None:
    """DeepSeek's MTP layers store their own embedding and head; ours are the model's (model/mtp.py), so the copies
    must equal what was loaded from the main ones (they do in DeepSeek's checkpoints and in our exports)."""
    params = dict(model.named_parameters())
    for key, ours in mtp_shared_copies(model.cfg):
        if r.has(key) and ours in params and not torch.equal(r.get(key, _part(params[ours])).to(params[ours].dtype),
                                                             params[ours]):
            raise ConfigError(f"init.from_hf={str(hf_dir)!r}: {key} differs from the model's own "
                              f"{hf_name('deepseek_v3', ours)}, which the MTP layers share (model/mtp.py)")


def load_pretrained(hf_dir: str | Path) -> tuple[Config, Transformer]:
    """(config, full model in eval mode) of a transformers checkpoint dir, in one process. Like transformers'
    from_pretrained for a model, it needs no tokenizer: cfg.data.tokenizer is DIR's tokenizer.json, or "" when
    DIR has none."""
    cfg = Config()
    cfg.init.from_hf = str(hf_dir)
    apply_init_config(cfg, need_tokenizer=False)
    cfg.train.seq_len = min(cfg.train.seq_len, cfg.model.max_seq_len)  # training keys only have to be valid
    if not cfg.data.tokenizer:  # no tokenizer to size: the data keys only have to fit the model
        cfg.data.vocab_size = min(cfg.data.vocab_size, cfg.model.vocab_size)
    validate(cfg)
    if why := does_not_fit(cfg, training=False):  # before the model is built: one line with the GiB it would take
        raise ConfigError(why)
    model = Transformer(cfg.model, seed=cfg.train.seed)
    load_into_shard(model, hf_dir)
    return cfg, model.eval()


def read_tensors(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint dir's safetensors files, whole (a check's, not a load's: `nanotitan verify
    --hf`)."""
    out = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(f, framework="pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})
    return out


# --- weights out --------------------------------------------------------------------------------

def _weights(model: Transformer, family: str):
    """(name, tensor) of what a checkpoint holds: the parameters, and DeepSeek-V3's router bias (a buffer here)."""
    yield from model.named_parameters()
    if family == "deepseek_v3":
        yield from ((n, b) for n, b in model.named_buffers() if n.endswith(".moe.router_bias"))


def hf_tensors(model: Transformer, family: str):
    """(HF name, tensor view) for every parameter of the (full) model, experts split and transposed."""
    for name, p in _weights(model, family):
        m = _EXPERT.fullmatch(name)
        if m:
            which = EXPERT_WEIGHTS.index(m[2])
            for l in range(p.shape[0]):
                yield hf_expert_name(family, int(m[1]), model.spec.expert_start + l, which), p[l].T
        elif family == "deepseek_v3":
            yield hf_name(family, name), rope_rows(model.cfg, name, p, to_hf=True)
            if name.endswith(".moe.router.weight") and model.cfg.bias_update_rate == 0:  # transformers' is zeros
                yield hf_name(family, name[:-len("router.weight")] + "router_bias"), p.new_zeros(p.shape[0])
        else:
            yield hf_name(family, name), p
    if family == "deepseek_v3":  # DeepSeek's MTP layers each hold a copy of the embedding and the head: copies on
        params = dict(model.named_parameters())  # disk too (safetensors refuses tensors sharing memory)
        yield from ((key, params[ours].detach().clone()) for key, ours in mtp_shared_copies(model.cfg))


@torch.no_grad()
def save_pretrained(model: Transformer, cfg: Config | ModelConfig, out_dir: str | Path, dtype: str = "fp32",
                    tokenizer: str | Path | None = None, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write DIR in transformers' layout: config.json for the matching class, model.safetensors (or
    model-0000i-of-0000n.safetensors + model.safetensors.index.json above max_shard_bytes) and, when given,
    the tokenizer (tokenizer.json + tokenizer_config.json). Needs the full model."""
    m = cfg.model if isinstance(cfg, Config) else cfg
    assert model.spec == ModelShardSpec.full(m), "save_pretrained needs the full model (nanotitan export builds it)"
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not one of {list(DTYPES)} (--dtype)")
    eos = None
    if tokenizer is not None:
        from ..data.tokenizer import eot_id, load_tokenizer_file

        tok = load_tokenizer_file(tokenizer)
        eos = eot_id(tok)
    hf = hf_config(m, eos, dtype)  # fails before anything is written
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch_dtype = DTYPES[dtype][0]

    # Plan the shards from shapes alone, then materialise one shard at a time (never a second full copy).
    entries = list(hf_tensors(model, hf["model_type"]))
    shards, size = [[]], 0
    for key, t in entries:
        nbytes = t.numel() * torch_dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((key, t))
        size += nbytes
    n = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: t.detach().to("cpu", torch_dtype).contiguous() for k, t in shard}, str(out / fname),
                  metadata={"format": "pt"})
        weight_map.update({k: fname for k, _ in shard})
    stale = [out / "model.safetensors.index.json"] if n == 1 else [out / "model.safetensors"]
    for f in stale:  # a previous export of another size must not shadow this one
        f.unlink(missing_ok=True)
    if n > 1:
        total = sum(t.numel() * torch_dtype.itemsize for _, t in entries)
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    if tokenizer is not None:
        if Path(tokenizer).resolve() != (out / "tokenizer.json").resolve():
            shutil.copyfile(tokenizer, out / "tokenizer.json")
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.id_to_token(eos),
             "model_max_length": m.max_seq_len}, indent=2))
    return out


def run_tokenizer(cfg: Config) -> Path | None:
    """The tokenizer a run trained with: its prepared data dir's tokenizer.json, else data.tokenizer."""
    from ..data.prepare import prepared_dir

    with contextlib.suppress(Exception):  # a missing data.tokenizer file or cache: fall through
        p = prepared_dir(cfg.data) / "tokenizer.json"
        if p.is_file():
            return p
    p = Path(cfg.data.tokenizer).expanduser() if cfg.data.tokenizer else None
    return p if p is not None and p.is_file() else None


def export_target(out_dir: str | Path, force: bool, name: str, fix: str) -> Path:
    """The directory an export writes into: new, or empty; one holding anything (an earlier export, other files) is
    refused in one line naming it as `name` ("--out" or "train.export_hf") and `fix`, unless `force` (the export then
    writes over its own file names)."""
    out = Path(out_dir)
    if not force and out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"{name} {str(out)!r} is not empty: {fix}")
    return out


def check_export_hf(cfg: Config) -> None:
    """train.export_hf, before anything trains: a new or empty directory, a model transformers can represent, and one
    that fits one process (rank 0 exports the whole model at the end)."""
    export_target(cfg.train.export_hf, False, "train.export_hf", "give a new or empty directory (--train.export_hf "
                  "DIR), or export later with `nanotitan export --force`")
    hf_config(cfg.model)  # an option transformers cannot represent: its one line now, not after training
    if why := does_not_fit(cfg, training=False, whole=True):
        raise ConfigError(f"train.export_hf={cfg.train.export_hf!r}: the whole model must fit one process: {why}")


def export_checkpoint(run_dir: str | Path, out_dir: str | Path, step: int | None = None,
                      dtype: str = "fp32") -> Path:
    """`nanotitan export`: a run's checkpoint (newest, or step N; any layout and zero level: checkpoints use
    global names) gathered into one process and written as a transformers checkpoint dir."""
    from ..state import checkpoint as ckpt
    from ..state import manifest
    from ..parallel.dims import ParallelDims

    run = Path(run_dir)
    path = manifest.saved_checkpoint(run, step)
    # The checkpoint's own config, as saved: resolved (resolve.py) before it was written, so it is used as it
    # is, and init.from_hf's directory need not exist any more.
    cfg = load_config(path / "config.toml")
    hf_config(cfg.model)  # an unexportable option fails before the weights are read
    if why := does_not_fit(cfg, training=False, whole=True):  # the whole model, in one process: the checkpoint's
        raise CheckpointError(f"{path / 'config.toml'}: {why}")  # config says so, and nothing can fit it here
    model = Transformer(cfg.model, seed=cfg.train.seed)
    ckpt.load_checkpoint(path, model, None, ParallelDims(1, 1, 1))
    tok = run_tokenizer(cfg)
    if tok is None:
        print(f"export: no tokenizer found for {run} (prepare its data, or set data.tokenizer); "
              "writing weights and config only")
    return save_pretrained(model, cfg, out_dir, dtype, tokenizer=tok)

