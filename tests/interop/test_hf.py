"""Hugging Face interop against transformers as the oracle (no hub: tiny random models built locally).

Contracts: for Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE an imported model's logits equal transformers'
(max |diff| <= 1e-5 of the logits' scale, fp32); an exported one loads in transformers with equal logits;
import -> export gives back bit-identical tensors; on layout (2,2,2) every rank loads exactly its slice
(reading only its own tensors), trains 5 steps like one process, and its checkpoint exports.
Cost: ~15 s in-process + one 8-rank launch (~30 s on 2 cores).
"""

import json
from pathlib import Path

import pytest
import torch

from nanotitan import cli
from nanotitan.interop import hf
from nanotitan.config.config import ConfigError, ModelConfig, load_config
from nanotitan.model.transformer import Transformer, is_expert_param
from nanotitan.parallel.dims import ParallelDims
from nanotitan.resolve import resolve
from tests.helpers.mp import run_ranks
from tests.helpers.hf import _assert_logits_close, _randomise, _tensors

V_TOK, V_MODEL = 300, 320  # tokenizer size, and a padded model vocab as real checkpoints have
COMMON = dict(vocab_size=V_MODEL, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=None,
              pad_token_id=None, tie_word_embeddings=False)
# Each family with its own features switched on: GQA everywhere; Qwen2 biases, a gated shared expert and a
# dense layer (mlp_only_layers) of another width; Qwen3 per-head q/k norms and head_dim != hidden/heads;
# OLMoE q/k norms over the whole projection; top-k renormalised or not.
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=24, num_local_experts=4, rope_theta=1e6)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=40, moe_intermediate_size=24, num_experts=4,
                                         shared_expert_intermediate_size=20, mlp_only_layers=[1],
                                         norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=40, moe_intermediate_size=24, num_experts=4, head_dim=12,
                                         norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=24, num_experts=4)),
}
ARCH = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
        "olmoe": "OlmoeForCausalLM"}


def _tiny_hf(family: str, out: Path, tokenizer: Path, eos: int, seed: int, **extra) -> Path:
    import transformers

    cls, kw = FAMILIES[family]
    kw = dict(kw)
    theta = kw.pop("rope_theta", 10000.0)
    config = getattr(transformers, cls)(**COMMON, **kw, eos_token_id=eos,
                                        rope_parameters={"rope_type": "default", "rope_theta": theta})
    for k, v in extra.pop("config", {}).items():
        setattr(config, k, v)
    model = transformers.AutoModelForCausalLM.from_config(config)
    _randomise(model.parameters(), seed)
    model.save_pretrained(out, **extra)
    (out / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    return out


def _hf_logits(path, x):
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(path).eval()(x).logits


@pytest.fixture(scope="module")
def tokenizer(corpus_dir, tmp_path_factory) -> Path:
    from nanotitan.data.tokenizer import train_bpe

    texts = [p.read_text() for p in sorted(corpus_dir.glob("*.txt"))[:5]]
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe(texts, V_TOK).save(str(path))
    return path


@pytest.fixture(scope="module")
def eos(tokenizer) -> int:
    from nanotitan.data.tokenizer import eot_id, load_tokenizer_file

    return eot_id(load_tokenizer_file(tokenizer))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory, tokenizer, eos) -> dict[str, Path]:
    """One tiny random checkpoint per family, as transformers saves it, plus two on-disk variants: fused
    experts (save_original_format=False) and tied embeddings (no lm_head tensor)."""
    root = tmp_path_factory.mktemp("hf")
    dirs = {f: _tiny_hf(f, root / f, tokenizer, eos, seed=i) for i, f in enumerate(FAMILIES)}
    dirs["qwen3_moe-fused"] = _tiny_hf("qwen3_moe", root / "fused", tokenizer, eos, 7, save_original_format=False)
    dirs["mixtral-tied"] = _tiny_hf("mixtral", root / "tied", tokenizer, eos, 8, config={"tie_word_embeddings": True})
    return dirs


X = torch.randint(0, V_TOK, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", [*FAMILIES, "qwen3_moe-fused", "mixtral-tied"])
def test_import_logits_equal_transformers(hf_dirs, name):
    d = hf_dirs[name]
    if name == "qwen3_moe-fused":  # the variant really is the fused on-disk form
        assert any(k.endswith("experts.gate_up_proj") for k in _tensors(d))
    cfg, model = hf.load_pretrained(d)
    assert cfg.data.tokenizer == str((d / "tokenizer.json").resolve())
    with torch.no_grad():
        got, _ = model(X)
    _assert_logits_close(got, _hf_logits(d, X))


EXPORT_OPTIONS = {  # our options -> the family that must be chosen
    "mixtral": ["--model.n_kv_heads", "2"],
    "qwen2_moe": ["--model.attn_bias", "true", "--model.shared_experts", "2", "--model.shared_ffn_dim", "12",
                  "--model.shared_expert_gate", "true", "--model.dense_layers", "1", "--model.dense_ffn_dim", "40",
                  "--model.norm_topk", "false"],
    "qwen3_moe": ["--model.qk_norm", "head", "--model.head_dim", "12", "--model.n_kv_heads", "2",
                  "--model.first_k_dense", "1"],
    "olmoe": ["--model.qk_norm", "full", "--model.norm_topk", "false", "--model.n_kv_heads", "1"],
}
SMALL = ["--model.d_model", "32", "--model.n_heads", "4", "--model.ffn_dim", "24", "--model.n_layers", "3",
         "--model.num_experts", "4", "--model.vocab_size", str(V_MODEL), "--model.max_seq_len", "64",
         "--data.vocab_size", str(V_TOK), "--train.seq_len", "16"]


@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_in_transformers_with_equal_logits(family, tokenizer, tmp_path):
    cfg = load_config(None, SMALL + EXPORT_OPTIONS[family] + ["--data.tokenizer", str(tokenizer)])
    model = Transformer(cfg.model, seed=3)
    _randomise(model.parameters(), seed=11)
    out = hf.save_pretrained(model, cfg, tmp_path / "out", tokenizer=tokenizer)
    assert json.loads((out / "config.json").read_text())["architectures"] == [ARCH[family]]
    with torch.no_grad():
        got, _ = model.eval()(X)
    _assert_logits_close(got, _hf_logits(out, X))


def test_import_export_round_trip_is_bit_identical(hf_dirs, tmp_path):
    """Per family, exported in shards of <= 20 kB (index file), and the sharded export imports back."""
    for name, d in hf_dirs.items():
        if name == "mixtral-tied":  # the export unties: lm_head becomes a tensor of its own
            continue
        cfg, model = hf.load_pretrained(d)
        out = hf.save_pretrained(model, cfg, tmp_path / name, tokenizer=d / "tokenizer.json", max_shard_bytes=20_000)
        assert (out / "model.safetensors.index.json").is_file() and not (out / "model.safetensors").exists()
        want, got = _tensors(d), _tensors(out)
        if name.endswith("fused"):  # exported per expert: compare with the fused tensors split
            want = _split_fused(want)
        assert want.keys() == got.keys(), name
        for k in want:
            assert want[k].dtype == got[k].dtype and torch.equal(want[k], got[k]), (name, k)
        _, again = hf.load_pretrained(out)
        for (n, p), (n2, q) in zip(model.named_parameters(), again.named_parameters()):
            assert n == n2 and torch.equal(p, q), (name, n)


def _split_fused(t: dict) -> dict:
    out = {}
    for k, v in t.items():
        if k.endswith("experts.gate_up_proj"):
            Fh = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = v[e, :Fh].contiguous()
                out[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = v[e, Fh:].contiguous()
        elif k.endswith("experts.down_proj"):
            for e in range(v.shape[0]):
                out[k.replace("down_proj", f"{e}.down_proj.weight")] = v[e].contiguous()
        else:
            out[k] = v
    return out


@pytest.mark.parametrize("args,needle", [
    (["--model.pos_emb", "learned"], "model.pos_emb=learned"),
    (["--model.norm_topk", "false"], "model.norm_topk=false"),
    (["--model.moe_every", "2"], "dense layers [1]"),
    (["--model.shared_experts", "1"], "model.shared_expert_gate=false"),
    (["--model.attn_bias", "true"], "model.attn_bias without model.shared_experts"),
    (["--model.qk_norm", "head", "--model.attn_bias", "true"], "model.attn_bias with qk_norm=head"),
    (["--model.qk_norm", "full", "--model.shared_experts", "1"], "model.shared_experts with qk_norm=full"),
    (["--model.router_score", "sigmoid"], "model.router_score=sigmoid"),
    (["--model.routed_scale", "2.5"], "model.routed_scale=2.5"),
    (["--model.bias_update_rate", "0.001"], "model.bias_update_rate=0.001"),
])
def test_unrepresentable_options_fail_in_one_line(args, needle, tmp_path):
    cfg = load_config(None, SMALL + args)
    with pytest.raises(ConfigError) as e:
        hf.save_pretrained(Transformer(cfg.model), cfg, tmp_path / "x")
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "x").exists()  # nothing written


def test_init_from_hf_sets_validates_and_refuses(hf_dirs, tmp_path):
    d = hf_dirs["qwen2_moe"]
    assert load_config(None, ["--init.from_hf", str(d)]).model == ModelConfig()  # read as written: resolve maps it
    cfg = resolve(load_config(None, ["--init.from_hf", str(d), "--train.seq_len", "16", "--model.n_layers", "3"]))
    m = cfg.model
    assert (m.n_layers, m.n_kv_heads, m.dense_layers, m.dense_ffn_dim, m.shared_ffn_dim, m.attn_bias,
            m.shared_expert_gate, m.norm_topk, m.vocab_size) == (3, 2, [1], 40, 20, True, True, False, V_MODEL)
    assert cfg.data.tokenizer == str((d / "tokenizer.json").resolve())
    for args, needle in [(["--model.n_layers", "4"], "model.n_layers=4 conflicts with init.from_hf"),
                         (["--data.tokenizer", str(tmp_path / "t.json")], "data.tokenizer="),
                         (["--model.qk_norm", "head"], "model.qk_norm=head conflicts")]:
        with pytest.raises(ConfigError, match=needle.replace("[", r"\[")) as e:
            resolve(load_config(None, ["--init.from_hf", str(d), "--train.seq_len", "16", *args]))
        assert "\n" not in str(e.value)
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(ConfigError, match="not supported .supported: MixtralForCausalLM, Qwen2MoeForCausalLM, "
                                          "Qwen3MoeForCausalLM, OlmoeForCausalLM"):
        resolve(load_config(None, ["--init.from_hf", str(llama)]))
    scaled = tmp_path / "scaled"
    scaled.mkdir()
    conf = json.loads((d / "config.json").read_text())
    conf["rope_parameters"] = {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}  # yarn is supported
    (scaled / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ConfigError, match="rope_type='linear'"):
        resolve(load_config(None, ["--init.from_hf", str(scaled)]))
    del conf["rope_parameters"], conf["moe_intermediate_size"]
    (scaled / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ConfigError, match="config.json has no 'moe_intermediate_size'"):
        resolve(load_config(None, ["--init.from_hf", str(scaled)]))


def test_export_cli_from_checkpoint_fp32_and_bf16(tokenizer, tmp_path):
    from nanotitan.state import checkpoint as ckpt

    run = tmp_path / "run"
    cfg = load_config(None, SMALL + EXPORT_OPTIONS["qwen3_moe"] + ["--data.tokenizer", str(tokenizer),
                                                                  "--run.dir", str(run)])
    model = Transformer(cfg.model, seed=3)
    _randomise(model.parameters(), seed=5)
    ckpt.save_checkpoint(run, 7, model, None, None, cfg)
    assert cli.main(["export", "--run.dir", str(run), "--out", str(tmp_path / "fp32")]) == 0
    assert cli.main(["export", "--run.dir", str(run), "--step", "7", "--out", str(tmp_path / "bf16"),
                     "--dtype", "bf16"]) == 0
    fp32, bf16 = _tensors(tmp_path / "fp32"), _tensors(tmp_path / "bf16")
    assert all(bf16[k].dtype == torch.bfloat16 and torch.equal(bf16[k], fp32[k].bfloat16()) for k in fp32)
    assert (tmp_path / "fp32" / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    with torch.no_grad():
        got, _ = model.eval()(X)
    _assert_logits_close(got, _hf_logits(tmp_path / "fp32", X))
    assert cli.main(["export", "--run.dir", str(run), "--step", "3", "--out", str(tmp_path / "x")]) == 2


def test_checkpoint_of_an_imported_model_exports_after_its_hf_dir_is_gone(hf_dirs, tmp_path):
    """A checkpoint's config.toml is the resolved config (model keys from init.from_hf's config.json), so export
    reads it as it is: the directory it was imported from may be gone, and nothing reads it again."""
    import shutil

    from nanotitan.state import checkpoint as ckpt

    src, run = tmp_path / "imported", tmp_path / "run"
    shutil.copytree(hf_dirs["qwen2_moe"], src)
    cfg = resolve(load_config(None, ["--init.from_hf", str(src), "--train.seq_len", "16", "--run.dir", str(run)]))
    model = Transformer(cfg.model, seed=3)
    hf.load_into_shard(model, src)
    ckpt.save_checkpoint(run, 1, model, None, None, cfg)
    shutil.rmtree(src)
    out = hf.export_checkpoint(run, tmp_path / "out")
    assert _tensors(out).keys() == _tensors(hf_dirs["qwen2_moe"]).keys()
    assert json.loads((out / "config.json").read_text())["shared_expert_intermediate_size"] == 20


def test_generate_cli_samples_with_the_imported_tokenizer(hf_dirs, capsys):
    from tokenizers import Tokenizer

    from nanotitan.generate import Sampling, sample

    d = hf_dirs["olmoe"]
    assert cli.main(["generate", "--init.from_hf", str(d), "--prompt", "the king", "--tokens", "8"]) == 0
    text = capsys.readouterr().out.rstrip("\n")
    cfg, model = hf.load_pretrained(d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert text == sample(model, tok, "the king", 8, Sampling(seed=cfg.train.seed))
    assert text.startswith("the king") and len(tok.encode(text).ids) >= len(tok.encode("the king").ids) + 1


# --- layout (2,2,2): 8 ranks, one launch ---------------------------------------------------------------

LAYOUT_222 = ["--parallel.dp", "2", "--parallel.pp", "2", "--parallel.ep", "2"]
B, m, STEPS = 8, 2, 5


def _train_args(corpus_dir, hf_dir, run_dir) -> list[str]:
    return ["--init.from_hf", str(hf_dir), "--data.source", str(corpus_dir), "--model.aux_coef", "0.05",
            "--train.steps", str(STEPS), "--train.lr", "3e-3", "--train.warmup_steps", "2", "--train.seq_len", "16",
            "--train.micro_batch", str(m), "--train.grad_clip", "0.5", "--train.eval_every", "0",
            "--train.sample_tokens", "0", "--train.threads", "1", "--run.dir", str(run_dir), "--run.log_every", "1",
            "--run.progress", "false", "--run.tensorboard", "false"]


def _rank_222(rank, world, dirs: dict, train_args: list[str]):
    """Each family: this rank's shard loaded alone; then 5 training steps from the imported Qwen2-MoE."""
    from tests.helpers.specs import build_shard_spec
    from nanotitan.train import Trainer

    dims = ParallelDims(2, 2, 2, rank=rank)
    out = {"coords": dims.coords(), "shards": {}}
    for name, d in dirs.items():
        cfg = resolve(load_config(None, ["--init.from_hf", d, "--train.seq_len", "16"] + LAYOUT_222))
        spec = build_shard_spec(cfg, dims.pp_rank, dims.ep_rank)
        model = Transformer(cfg.model, spec, seed=cfg.train.seed)
        read = hf.load_into_shard(model, d)
        out["shards"][name] = (spec, read, {n: p.detach().clone() for n, p in model.named_parameters()})
    trainer = Trainer(load_config(None, train_args + LAYOUT_222 + ["--parallel.microbatches", "1"]))
    out["init"] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    res = trainer.train()
    out["final"] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    out["losses"] = [r["loss"] for r in res["history"]]
    trainer.shard.close()
    return out


def _owns(spec, key: str) -> bool:
    """Is HF tensor `key` part of this shard (its layers, its experts, its embeddings/head)?"""
    parts = key.split(".")
    if key.startswith("model.layers."):
        layer = int(parts[2])
        if ".experts." in key:
            e = parts[parts.index("experts") + 1]
            if e.isdigit() and not spec.expert_start <= int(e) < spec.expert_end:
                return False
        return spec.layer_start <= layer < spec.layer_end
    return spec.has_token_embed if key.startswith("model.embed_tokens") else spec.has_head


def test_layout_222_loads_slices_trains_like_one_process_and_exports(hf_dirs, corpus_dir, tmp_path):
    dirs = {k: str(v) for k, v in hf_dirs.items() if k != "mixtral-tied"}
    ranks = run_ranks(_rank_222, 8, args=(dirs, _train_args(corpus_dir, hf_dirs["qwen2_moe"], tmp_path / "r222")),
                      timeout=300)

    # 1. every rank holds exactly its slice of the single-process import, and read nothing else
    for name, d in dirs.items():
        _, full = hf.load_pretrained(d)
        full_params = dict(full.named_parameters())
        all_read = set()
        for r in ranks:
            spec, read, params = r["shards"][name]
            for n, p in params.items():
                want = full_params[n][spec.expert_start:spec.expert_end] if is_expert_param(n) else full_params[n]
                assert torch.equal(p, want), (name, r["coords"], n)
            assert all(_owns(spec, k) for k in read), (name, r["coords"], [k for k in read if not _owns(spec, k)])
            all_read |= set(read)
        assert all_read == set(_tensors(Path(d))), name

    # 2. training starts from the imported weights on every rank ...
    _, imported = hf.load_pretrained(hf_dirs["qwen2_moe"])
    imp = dict(imported.named_parameters())
    for r in ranks:
        spec = r["shards"]["qwen2_moe"][0]
        for n, p in r["init"].items():
            want = imp[n][spec.expert_start:spec.expert_end] if is_expert_param(n) else imp[n]
            same = torch.equal(p, want)
            assert same, f"rank {r['coords']}: {n} is not the imported weight (parallelize must load_into_shard)"

    # ... and its 5 steps equal one process accumulating the same 4 microbatches
    from nanotitan.train import Trainer

    torch.set_num_threads(1)
    ref = Trainer(load_config(None, _train_args(corpus_dir, hf_dirs["qwen2_moe"], tmp_path / "r111")
                              + ["--parallel.microbatches", str(B // m)]))
    ref_losses = [r["loss"] for r in ref.train()["history"]]
    ref.shard.close()
    losses = ranks[0]["losses"]
    assert len(losses) == STEPS
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step + 1}: (2,2,2) loss {a} vs one process {b}"

    # 3. the (2,2,2) run's checkpoint exports: the HF tensors are the ranks' final weights, and transformers
    # computes our logits from them
    out = hf.export_checkpoint(tmp_path / "r222", tmp_path / "exported")
    exported = _tensors(out)
    cfg, again = hf.load_pretrained(out)
    for r in ranks:
        for n, p in r["final"].items():
            q = dict(again.named_parameters())[n]
            spec = r["shards"]["qwen2_moe"][0]
            assert torch.equal(p, q[spec.expert_start:spec.expert_end] if is_expert_param(n) else q), n
    assert len(exported) == len(_tensors(hf_dirs["qwen2_moe"]))
    with torch.no_grad():
        got, _ = again(X)
    _assert_logits_close(got, _hf_logits(out, X))


def _rank_cp2(rank, world, train_args: list[str]):
    from tests.helpers.equivalence import train_tp

    return train_tp(train_args)


def test_init_from_hf_into_cp2_trains_like_one_process(hf_dirs, corpus_dir, tmp_path):
    """--init.from_hf into a CP layout (parallel.cp 2, experts folded over the CP ranks): every CP rank starts from
    the imported weights (replicated; its experts' slice), so its 5 steps and final weights are one process's."""
    from tests.helpers.equivalence import train_tp

    d = hf_dirs["qwen2_moe"]
    cp2 = ["--parallel.cp", "2", "--parallel.microbatches", str(B // m), "--train.ckpt_at_end", "false"]
    ranks = run_ranks(_rank_cp2, 2, args=(_train_args(corpus_dir, d, tmp_path / "cp2") + cp2,), timeout=300)
    torch.set_num_threads(1)
    ref = train_tp(_train_args(corpus_dir, d, tmp_path / "one") + cp2[2:])
    assert len(ranks[0]["losses"]) == STEPS
    for step, (a, b) in enumerate(zip(ranks[0]["losses"], ref["losses"])):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step + 1}: CP2 loss {a} vs one process {b}"
    for r in ranks:
        for n, (p, start, _) in r["params"].items():
            want = ref["params"][n][0]
            want = want[start:start + p.shape[0]] if start is not None else want
            torch.testing.assert_close(p, want, rtol=1e-4, atol=1e-3 * 3e-3 * STEPS, msg=lambda s: f"{n}: {s}")
