"""A TP rank builds its shard without the whole stage (parallel/build.py, docs/tp.md "How a rank builds its shard").

Pinned here, in one process (slicing needs no process group; one rank of each check runs `parallelize` itself
under a fake process group):
- random init: every rank's parameters, their TP tags and its buffers equal, bit for bit, the slices of the stage
  built whole and sliced (the path before build.py), at TP 1/2/4, GQA with its KV heads split and replicated, an
  MLA/DeepSeek-shaped model, and an interleaved stage of two chunks;
- init.from_hf: every rank holds exactly its slice of the one-process import, and reads exactly the elements it
  holds (Qwen2-MoE-shaped with GQA, biases, a gated shared expert and a dense layer; tied embeddings; DeepSeek-V3
  with MLA and its interleaved rope rows; OLMoE with its full q/k norms sliced with the heads);
- memory: the live bytes of a TP rank's build peak at its shard plus one whole parameter, where building the
  stage whole and slicing it (measured beside it) exceeds that bound.
"""

import json
import weakref

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from nanotitan.config.config import load_config
from nanotitan.interop import hf
from nanotitan.interop.deepseek import mtp_shared_copies
from nanotitan.model.spec import build_chunk_specs
from nanotitan.model.transformer import Transformer, is_expert_param
from nanotitan.parallel.build import build_stage
from nanotitan.parallel.dims import ParallelDims
from nanotitan.parallel.pp.chunks import StageChunks
from nanotitan.parallel.tp import apply_tp, is_tp_partial, tp_part, tp_shard, tp_shard_dim

CPU = torch.device("cpu")
BASE = ["--model.d_model", "32", "--model.n_heads", "4", "--model.ffn_dim", "48", "--model.n_layers", "2",
        "--model.num_experts", "4", "--model.top_k", "2", "--model.vocab_size", "320", "--data.vocab_size", "300",
        "--train.seq_len", "16", "--model.max_seq_len", "16", "--train.seed", "3"]
# Qwen2-MoE-shaped: GQA (2 KV heads: split at TP2, replicated at TP4), q/k/v biases, a gated shared expert, a dense
# layer, the router bias buffer
GQA = [*BASE, "--model.n_kv_heads", "2", "--model.attn_bias", "true", "--model.shared_experts", "1",
       "--model.shared_expert_gate", "true", "--model.dense_layers", "1", "--model.dense_ffn_dim", "40",
       "--model.norm_topk", "false"]
# DeepSeek-V3-shaped: MLA with a q latent, YaRN rope tables, sigmoid group-limited routing with its bias, a dense
# first layer, a shared expert, one MTP depth
DEEPSEEK = [*BASE, "--model.mtp_layers", "1", "--model.n_layers", "3", "--model.first_k_dense", "1", "--model.shared_experts", "1",
            "--model.kv_lora_rank", "16", "--model.q_lora_rank", "12", "--model.qk_nope_head_dim", "8",
            "--model.qk_rope_head_dim", "4", "--model.v_head_dim", "8", "--model.n_group", "2",
            "--model.topk_group", "1", "--model.router_score", "sigmoid", "--model.routed_scale", "2.5",
            "--model.bias_update_rate", "1e-3", "--model.rope_scaling", "yarn", "--model.rope_factor", "2",
            "--model.rope_original_max_len", "8", "--model.rope_mscale_all_dim", "1"]
# OLMoE-shaped: q/k norms over the whole projections (sliced with the heads; the k one whole at TP4)
OLMOE = [*BASE, "--model.qk_norm", "full", "--model.n_kv_heads", "2", "--model.norm_topk", "false"]
INTERLEAVED = [*GQA, "--model.n_layers", "4", "--model.dense_layers", "", "--parallel.pp", "2",
               "--parallel.schedule", "interleaved", "--parallel.microbatches", "2"]


def _cfg(flags, tp):
    return load_config(None, [*flags, "--parallel.tp", str(tp)])


def _ranks(cfg):
    p = cfg.parallel
    return [ParallelDims(1, p.pp, 1, rank=r, tp=p.tp) for r in range(p.pp * p.tp)]


def _whole_then_sliced(cfg, dims):
    """The build before parallel/build.py: every chunk whole and initialised, then sliced by apply_tp."""
    specs = build_chunk_specs(cfg, dims.pp_rank, dims.moe_ep_rank)
    tokens = tp_shard(dims, cfg.parallel.sp)
    chunks = [Transformer(cfg.model, s, seed=cfg.train.seed, tokens=tokens) for s in specs]
    model = chunks[0] if len(chunks) == 1 else StageChunks(chunks)
    apply_tp(model)
    return model


def _parallelize(cfg, dims, load_weights=None):
    """The rank's shard as `parallelize` builds it, in this process: a fake process group of the rank's world (its
    broadcasts send nothing: the shard is what this rank built)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from nanotitan.parallel.parallelize import parallelize

    dist.init_process_group("fake", store=FakeStore(), rank=dims.rank, world_size=dims.world_size)
    try:
        dims.build_groups(timeout_s=60)
        shard = parallelize(cfg, dims, CPU, load_weights)
        shard.close()
        return shard.model
    finally:
        dist.destroy_process_group()


def _state(model):
    return ({n: (p.detach(), tp_shard_dim(p), tp_part(p), is_tp_partial(p)) for n, p in model.named_parameters()},
            dict(model.named_buffers()))


@pytest.mark.parametrize("flags, tps", [(GQA, (1, 2, 4)), (DEEPSEEK, (2, 4)), (INTERLEAVED, (2,)), (OLMOE, (4,))],
                         ids=["gqa", "deepseek", "interleaved", "olmoe"])
def test_random_init_equals_slices_of_the_whole_build(flags, tps):
    for tp in tps:
        cfg = _cfg(flags, tp)
        for dims in _ranks(cfg):
            specs = build_chunk_specs(cfg, dims.pp_rank, dims.moe_ep_rank)
            # one rank through `parallelize` itself, the others through the build it calls
            via = _parallelize(cfg, dims) if (tp, dims.rank) == (2, 1) else build_stage(cfg, specs, dims, CPU)
            got, want = via, _whole_then_sliced(cfg, dims)
            (gp, gb), (wp, wb) = _state(got), _state(want)
            assert list(gp) == list(wp) and list(gb) == list(wb) and gb
            for n, (t, *tags) in wp.items():
                assert tuple(gp[n][1:]) == tuple(tags), (tp, dims.rank, n)
                assert gp[n][0].dtype == t.dtype and torch.equal(gp[n][0], t), (tp, dims.rank, n)
            assert all(torch.equal(gb[n], b) for n, b in wb.items()), tp
            assert not any(t.is_meta for m in got.modules() for t in vars(m).values() if isinstance(t, torch.Tensor))
            if tp > 1 and hasattr(want, "tok_emb"):
                assert type(got.tok_emb) is type(want.tok_emb) and got.tok_emb.vocab_start == want.tok_emb.vocab_start
        if flags in (GQA, OLMOE) and tp == 4:  # the replicated KV heads stay whole on every rank
            attn = got.layers["0"].attn
            assert tp_part(attn.k_proj.weight) is None and is_tp_partial(attn.k_proj.weight)
        if flags is OLMOE:  # the q norm sliced with its heads; the k norm over the whole replicated k
            assert tp_part(attn.q_norm.weight) == (0, dims.rank, 4) and attn.q_norm.weight.shape == (8,)
            assert tp_part(attn.k_norm.weight) is None and is_tp_partial(attn.k_norm.weight)


# --- init.from_hf ------------------------------------------------------------------------------------------------

def _checkpoint(flags, out, tied=False):
    """A transformers-format checkpoint of a randomised model (norms, biases and the router bias away from their
    init), written by our exporter; `tied`: lm_head removed, as a tie_word_embeddings checkpoint stores it."""
    cfg = _cfg(flags, 1)
    model = Transformer(cfg.model, seed=cfg.train.seed)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for t in [*model.parameters(), *(b for n, b in model.named_buffers() if n.endswith("router_bias"))]:
            t.copy_(torch.randn(t.shape, generator=g) * 0.2 + (t.dim() == 1))
    hf.save_pretrained(model, cfg, out)
    if tied:
        path = out / "model.safetensors"
        with safe_open(path, framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys() if k != "lm_head.weight"}
        save_file(tensors, str(path), metadata={"format": "pt"})
        conf = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(conf | {"tie_word_embeddings": True}))
    ref = Transformer(cfg.model, seed=0)
    hf.load_into_shard(ref, out)
    return ref


@pytest.mark.parametrize("flags, tied", [(GQA, False), (GQA, True), (DEEPSEEK, False), (OLMOE, False)],
                         ids=["qwen2", "tied", "deepseek", "olmoe"])
def test_from_hf_reads_only_the_slice_equal_to_the_tp1_import(flags, tied, tmp_path, monkeypatch):
    ref = _checkpoint(flags, tmp_path, tied)
    if tied:
        assert torch.equal(ref.head.weight, ref.tok_emb.weight)
    ref_params, ref_buffers = dict(ref.named_parameters()), dict(ref.named_buffers())
    read, get = [0], hf._Reader.get

    def counted(*args, **kwargs):
        t = get(*args, **kwargs)
        read[0] += t.numel()
        return t

    monkeypatch.setattr(hf._Reader, "get", counted)
    for tp in (2, 4):
        cfg = _cfg(flags, tp)
        for dims in _ranks(cfg):
            specs = build_chunk_specs(cfg, 0, dims.moe_ep_rank)
            read[0] = 0
            if (tp, dims.rank) == (2, 1):  # through `parallelize` itself, with the loader train.py hands it
                cfg.init.from_hf = str(tmp_path)
                got = _parallelize(cfg, dims, hf.shard_loader(cfg))
            else:
                got = build_stage(cfg, specs, dims, CPU, lambda chunk: hf.load_into_shard(chunk, tmp_path))
            held = 0
            for n, p in got.named_parameters():
                want = ref_params[n]
                if is_expert_param(n):
                    want = want[specs[0].expert_start:specs[0].expert_end]
                if (part := tp_part(p)) is not None:
                    dim, rank, k = part
                    want = want.chunk(k, dim)[rank]
                assert torch.equal(p, want), (tp, dims.rank, n)
                held += p.numel()
            for n, b in got.named_buffers():
                assert torch.equal(b, ref_buffers[n]), (tp, dims.rank, n)
                held += b.numel() if n.endswith("router_bias") else 0
            # DeepSeek's MTP layers keep copies of the embedding and head: their slices are read to check them
            params = dict(got.named_parameters())
            held += sum(params[ours].numel() for _, ours in mtp_shared_copies(cfg.model) if ours in params)
            assert read[0] == held, (tp, dims.rank, read[0], held)  # only its slices were read


# --- memory ------------------------------------------------------------------------------------------------------

class _LiveBytes(TorchDispatchMode):
    """High-water mark of the bytes of real (not meta) tensor storages created while active and still alive."""

    def __init__(self):
        super().__init__()
        self.live, self.current, self.peak = {}, 0, 0

    def _free(self, key):
        self.current -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                s = t.untyped_storage()
                if s._cdata not in self.live and s.nbytes():
                    self.live[s._cdata] = s.nbytes()
                    self.current += s.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(s, self._free, s._cdata)
        return out


def build_peak(cfg, dims, whole: bool) -> tuple[int, int, int, int]:
    """(peak live bytes of building this rank's stage, the bytes the build leaves alive, its shard's bytes (params
    + buffers), the largest whole parameter's bytes), building it whole then slicing (whole=True: the old path) or
    through build_stage. What it leaves alive is the shard and any small tables beside it (under static dispatch
    the expert shard's placement tables, made before any trace; none here)."""
    specs = build_chunk_specs(cfg, dims.pp_rank, dims.moe_ep_rank)
    with _LiveBytes() as meter:
        model = _whole_then_sliced(cfg, dims) if whole else build_stage(cfg, specs, dims, CPU)
    shard = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    largest = max(p.numel() * p.element_size() * (tp_part(p) or (0, 0, 1))[2] for p in model.parameters())
    return meter.peak, meter.current, shard, largest


def test_no_rank_builds_the_whole_stage():
    """Building a rank's stage holds at most one whole parameter beyond what the build keeps."""
    flags = [*BASE, "--model.d_model", "64", "--model.ffn_dim", "96", "--model.n_layers", "4",
             "--model.vocab_size", "512"]
    for tp in (2, 4):
        cfg = _cfg(flags, tp)
        for dims in _ranks(cfg)[:2]:
            peak, kept, shard, largest = build_peak(cfg, dims, whole=False)
            old_peak, old_kept, old_shard, _ = build_peak(cfg, dims, whole=True)
            assert old_shard == shard and shard <= kept < shard + 4096, (shard, kept)  # tables: bytes, not weights
            assert peak <= kept + largest, (tp, peak, kept, largest)
            assert old_peak > old_kept + largest, (tp, old_peak, old_kept, largest)  # the old path fails the bound


if __name__ == "__main__":  # docs/tp.md's table: python -m tests.parallel.test_tp_init CONFIG [--section.key VALUE ...]
    import sys

    torch.set_num_threads(1)
    MiB = 2 ** 20
    for tp in (1, 2, 4):
        cfg = load_config(sys.argv[1], [*sys.argv[2:], "--parallel.tp", str(tp)])
        cfg.model.vocab_size = cfg.model.vocab_size or cfg.data.vocab_size
        dims = ParallelDims(1, 1, 1, rank=0, tp=tp)
        (after, _, shard, largest), (before, _, _, _) = build_peak(cfg, dims, False), build_peak(cfg, dims, True)
        print(f"tp {tp}: shard {shard / MiB:.2f} MiB, largest whole param {largest / MiB:.2f} MiB, "
              f"build peak before {before / MiB:.2f} MiB, after {after / MiB:.2f} MiB")
