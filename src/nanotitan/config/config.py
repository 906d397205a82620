"""Typed configuration: TOML file + dotted CLI overrides, validated before anything runs.

A leaf: nothing of the package outside config/ is imported here (errors.py, parse.py for the values, fits.py's
memory arithmetic), so every layer can read the config. resolve.py makes it concrete: docs/config.md "Auto values".

Every user-facing error is a `ConfigError` whose message is one line naming the field and the fix,
e.g. "model.top_k=5 must be <= model.num_experts=4 (--model.top_k)".
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal

from .errors import ConfigError, check as _check
from .fits import vocab_too_large
from .parse import parse_overrides, set_value, tidy_counts
from .controls_rules import check_controls
from .elastic_rules import check_elastic
from .run_rules import check_run
from .cp_rules import check_cp
from .dispatch_rules import check_dispatch, check_graphs
from .fp8_rules import FP8_SKIP, check_fp8
from .packed_rules import check_packed
from .layout import check_expert_fold, expert_ranks
from .packed_rules import check_packed
from .placement_rules import check_placement
from .tp_rules import check_tp


@dataclass(kw_only=True)
class ModelConfig:
    # --- shape and attention ---
    vocab_size: int = 0  # 0 = take it from data.vocab_size (the tokenizer's size)
    d_model: int = 128  # width of the residual stream (hidden size D)
    n_layers: int = 4  # transformer blocks
    n_heads: int = 4  # attention heads (must divide d_model)
    n_kv_heads: int = 0  # key/value heads of grouped-query attention (0 = n_heads; must divide n_heads)
    head_dim: int = 0  # width of one attention head (0 = d_model / n_heads; Qwen3-MoE sets it)
    # RMSNorm on q and k: none, per head (head: Qwen3-MoE) or over the whole projection (full: OLMoE)
    qk_norm: Literal["none", "head", "full"] = "none"
    attn_bias: bool = False  # biases on the q/k/v projections (Qwen2-MoE)
    ffn_dim: int = 256  # hidden size of each SwiGLU expert (and of the dense FFN)
    # --- MoE: experts and routing ---
    num_experts: int = 4  # experts per MoE layer (parallel.ep must divide it)
    top_k: int = 2  # experts each token is routed to
    moe_every: int = 1  # MoE FFN in every k-th layer (layer i is MoE if i % moe_every == 0), dense SwiGLU otherwise
    first_k_dense: int = 0  # the first k layers are dense whatever moe_every says (DeepSeek's first_k_dense_replace)
    dense_layers: list[int] = field(default_factory=list)  # layers kept dense whatever moe_every says
    dense_ffn_dim: int = 0  # hidden size of the dense SwiGLU layers (0 = ffn_dim)
    shared_experts: int = 0  # always-on experts per MoE layer, replicated like attention weights (Qwen2-MoE: 1)
    shared_ffn_dim: int = 0  # hidden size of each shared expert (0 = ffn_dim)
    shared_expert_gate: bool = False  # scale the shared experts' output by sigmoid(x @ w) per token (Qwen2-MoE)
    norm_topk: bool = True  # renormalise the top-k router weights to sum to 1 (Mixtral does)
    aux_coef: float = 0.01  # Switch/GShard load-balancing loss coefficient
    # balance loss over each microbatch (micro), or per sequence then averaged (sequence: DeepSeek-V3)
    aux_scope: Literal["micro", "sequence"] = "micro"
    # router z-loss coefficient: the mean squared logsumexp of the router logits (ST-MoE: 1e-3; 0 = off)
    z_loss_coef: float = 0.0
    # router scores: a softmax over experts (softmax: Mixtral), or a sigmoid per expert (sigmoid: DeepSeek-V3)
    router_score: Literal["softmax", "sigmoid"] = "softmax"
    routed_scale: float = 1.0  # multiplies the routed experts' weights (DeepSeek's routed_scaling_factor)
    # aux-loss-free balancing: each step moves the router biases by this toward equal load (DeepSeek-V3: 1e-3; 0 = off)
    bias_update_rate: float = 0.0
    # tokens an expert takes per microbatch, as a multiple of m*S*top_k/num_experts (0 = dropless)
    capacity_factor: float = 0.0
    # --- positions, norms and init ---
    # positions: rotary embeddings (rope), or a learned position table (learned)
    pos_emb: Literal["rope", "learned"] = "rope"
    # attention: causal over the whole window, or doc: within each EOT-ended document only (docs/packed.md)
    attn_mask: Literal["causal", "doc"] = "causal"
    # with attn_mask=doc: positions restart at each document (doc), or count from the window's start (global)
    doc_positions: Literal["doc", "global"] = "doc"
    rope_theta: float = 10000.0  # RoPE base frequency
    max_seq_len: int = 1024  # size of the learned position table
    norm_eps: float = 1e-5  # RMSNorm epsilon
    init_std: float = 0.02  # std of the normal init of weight matrices
    # --- multi-head latent attention (DeepSeek-V2/V3; on when kv_lora_rank > 0; docs/config.md) ---
    # rank of the query's low-rank path, with its RMSNorm (0 = a full-rank q projection, as DeepSeek-V2-Lite)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0  # rank of the key/value latent, with its RMSNorm (0 = no MLA)
    qk_nope_head_dim: int = 0  # per-head query/key width without RoPE (MLA)
    qk_rope_head_dim: int = 0  # per-head query/key width with RoPE; the key's is one shared head (MLA)
    v_head_dim: int = 0  # per-head value width (MLA)
    # --- YaRN RoPE scaling (DeepSeek-V3, and the other families where their HF configs carry it) ---
    # RoPE frequency scaling for long contexts: none, or yarn (YaRN, set by the rope_* keys below)
    rope_scaling: Literal["none", "yarn"] = "none"
    rope_factor: float = 1.0  # YaRN: context extension factor
    rope_original_max_len: int = 0  # YaRN: original_max_position_embeddings (0 = max_seq_len)
    rope_beta_fast: float = 32.0  # YaRN: fast-rotation boundary (beta_fast)
    rope_beta_slow: float = 1.0  # YaRN: slow-rotation boundary (beta_slow)
    rope_mscale: float = 1.0  # YaRN: mscale (DeepSeek: also scales MLA's softmax scale, with mscale_all_dim)
    rope_mscale_all_dim: float = 0.0  # YaRN: mscale_all_dim (0 = unused)
    # --- DeepSeekMoE's group-limited routing (1/1 = plain top-k; docs/config.md) ---
    n_group: int = 1  # expert groups (must divide num_experts)
    topk_group: int = 1  # groups each token may route into (<= n_group)
    # Multi-token prediction (DeepSeek-V3 §2.2): module k predicts token t+k+1 from [RMSNorm(h); RMSNorm(emb(t+k))].
    mtp_layers: int = 0  # MTP modules (DeepSeek's num_nextn_predict_layers; 0 = off)
    mtp_coef: float = 0.3  # weight of the mean MTP loss added to the main loss (DeepSeek-V3's lambda)
    # routed experts: a GEMM per expert (loop), one grouped GEMM per projection (grouped), or auto (docs/moe.md)
    experts_impl: Literal["loop", "grouped", "auto"] = "loop"


@dataclass(kw_only=True)
class DataConfig:
    source: str = "shakespeare"  # "shakespeare", an HF hub dataset name, or a local file/dir/glob (docs/config.md)
    mix: str = ""  # "SRC:W,SRC:W": batches blend these prepared sources by weight, instead of source (docs/data.md)
    vocab_size: int = 2048  # BPE vocabulary trained on the corpus
    tokenizer: str = ""  # path to an existing tokenizer.json (empty = train a byte-level BPE)
    text_field: str = "text"  # column of jsonl/parquet/HF records that holds the text
    # indexed reads the prepared token files by global index (resumable); streaming reads an HF dataset as it goes
    loader: Literal["indexed", "streaming"] = "indexed"
    # text: documents split at EOT; sft: .jsonl prompt/response records, loss on the responses (docs/packed.md)
    format: Literal["text", "sft"] = "text"
    val_fraction: float = 0.05  # share of the corpus held out for val_loss
    max_docs: int = 0  # cap on documents read from a streaming/hub source when preparing (0 = all)
    cache_dir: str = ""  # where prepared corpora live (default: ~/.cache/nanotitan)
    shuffle_buffer: int = 10_000  # streaming loader's shuffle buffer


@dataclass(kw_only=True)
class TrainConfig:
    # --- optimizer and LR schedule ---
    steps: int = 300  # optimizer steps to train
    seed: int = 1337  # seeds the init (by global parameter name) and the data order
    lr: float = 3e-3  # peak learning rate, reached after warmup
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 30  # steps of linear LR warmup
    # the lr after warmup: cosine decay, wsd (stable, then a final decay) or constant (docs/config.md)
    lr_schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    lr_decay_frac: float = 0.2  # wsd: the last share of train.steps, decayed on a cosine to lr * min_lr_ratio
    weight_decay: float = 0.1  # AdamW decay, on matrices only
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    # adamw on every parameter, or muon: Muon on the hidden matrices and AdamW on the rest (docs/optim.md)
    optimizer: Literal["adamw", "muon"] = "adamw"
    muon_lr: float = 3e-3  # Muon's peak lr (same schedule as train.lr; updates RMS-matched to AdamW's, docs/optim.md)
    muon_adamw_lr: float = 1e-2  # under Muon: AdamW's peak lr for the rest (embeddings, head, norms, router; optim.md)
    muon_momentum: float = 0.95  # Muon's Nesterov momentum
    muon_ns_steps: int = 5  # Newton-Schulz iterations per orthogonalization
    # Newton-Schulz dtype: fp32 (held to 1e-5), or bf16 (2.2x faster on avx512_bf16, not held to it; docs/optim.md)
    muon_ns_dtype: Literal["fp32", "bf16"] = "fp32"
    qk_clip: float = 0.0  # QK-clip TAU: scale a head's q/k weights when its max logit tops it (0 = off, docs/optim.md)
    reset_optimizer: bool = False  # on resume: fresh optimizer state (needed to resume under another train.optimizer)
    # --- batch and sequence ---
    grad_clip: float = 1.0  # max global gradient norm (0 disables clipping)
    micro_batch: int = 4  # m: sequences per microbatch
    global_batch: int = 0  # B sequences per step; 0 = dp*ep*microbatches*micro_batch (kept fixed by --parallel.auto)
    seq_len: int = 128  # S: tokens per sequence
    # --- evaluation and checkpoints ---
    eval_every: int = 100  # steps between val_loss evals (0 disables periodic eval)
    eval_batches: int = 4  # global batches of the val split per eval
    activation_checkpointing: bool = False  # recompute each block in backward instead of keeping its activations
    ckpt_every: int = 0  # 0 = only at the end (when ckpt_at_end)
    ckpt_at_end: bool = True  # the sample at the end and `nanotitan generate` load it
    keep_last: int = 2  # checkpoints kept in run.dir (older ones are deleted; 0 keeps all)
    export_hf: str = ""  # a directory: at the end, rank 0 exports the final checkpoint for transformers (docs/hf.md)
    # "" continues run.dir's own checkpoints (same config), else starts fresh; auto, never or a PATH
    # (docs/checkpoint.md)
    resume: str = ""
    allow_data_change: bool = False  # on resume: accept data prepared with another tokenizer (docs/checkpoint.md)
    # --- failures ---
    on_nonfinite: Literal["stop", "skip"] = "stop"  # on a non-finite loss or grad norm: stop or skip (docs/config.md)
    max_skips: int = 3  # with on_nonfinite=skip: stop after this many skipped steps in a row
    verify_ckpt: bool = True  # checksum every checkpoint file against its manifest before loading (docs/config.md)
    ckpt_on_signal: bool = False  # on SIGTERM every rank finishes its step, saves a checkpoint and exits
    max_restarts: int = 0  # restarts of the whole job after a rank fails; an elastic job: 3 unless set (docs/config.md)
    # --- device, precision and compile ---
    threads: int = 0  # torch threads per rank (0 = cores / local ranks)
    # where ranks compute: auto = CUDA when visible, else CPU (gloo); or cpu, or cuda
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # compute dtype: fp32, or bf16 (the forward under bf16 autocast, fp32 weights and optimizer; docs/precision.md)
    dtype: Literal["fp32", "bf16"] = "fp32"
    peak_flops: float = 0.0  # FLOP/s per rank for MFU (0 = measured GEMM on CPU, datasheet on GPU)
    sample_tokens: int = 100  # tokens generated at the end (0 disables)
    compile: bool = False  # torch.compile each transformer block (torchtitan's per-block compile) (docs/config.md)
    cuda_graphs: bool = False  # with compile on CUDA: compiled blocks' graphs replayed as CUDA graphs (docs/compile.md)
    # FP8 GEMMs with dynamic scaling: off, tensorwise (one scale a tensor), rowwise (one a row) or mxfp8 (one per
    # 32 elements; docs/fp8.md)
    fp8: Literal["off", "tensorwise", "rowwise", "mxfp8"] = "off"
    fp8_skip: list[str] = field(default_factory=lambda: list(FP8_SKIP))  # modules kept out of FP8 (docs/fp8.md)


@dataclass(kw_only=True)
class ParallelConfig:
    # --- the axes ---
    dp: int = 1  # data-parallel replicas
    pp: int = 1  # pipeline stages
    ep: int = 1  # expert-parallel ranks sharing each MoE layer's experts
    tp: int = 1  # tensor-parallel ranks splitting attention, dense FFNs, shared experts (docs/config.md)
    sp: bool = True  # with tp > 1: sequence parallel (norms and residuals on sequence shards)
    cp: int = 1  # context-parallel ranks splitting every sequence, chunks i and 2cp-1-i each (docs/cp.md)
    # attention under CP: ring passes K/V around the CP ring, a2a is Ulysses' all-to-all over heads (docs/cp.md)
    cp_impl: Literal["ring", "a2a"] = "ring"
    # which positions each CP rank holds: zigzag's chunks i and 2cp-1-i, or (model.attn_mask=doc) per microbatch,
    # balanced over its documents' attention work (docs/cp.md)
    cp_split: Literal["zigzag", "docs"] = "zigzag"
    # --- pipeline ---
    microbatches: int = 1  # M per data rank per step
    # pipeline schedule when pp > 1: gpipe, 1f1b, interleaved (with virtual_stages) or zb1 (zero bubble; docs/pp.md)
    schedule: Literal["gpipe", "1f1b", "interleaved", "zb1"] = "1f1b"
    virtual_stages: int = 1  # model chunks per pipeline rank under schedule=interleaved (docs/config.md)
    # layers per stage: a list such as 1.5,2.5 (x.5 cuts a block), auto (balanced by cost), or empty = even
    pp_layers: list[float] | Literal["auto"] = field(default_factory=list)
    # --- data parallel and ZeRO ---
    bucket_mb: float = 25.0  # gradient all-reduce bucket size (MiB)
    # DP gradient sync: bucketed (our Reducer, every layout) or torch_ddp (torch DDP, pure DP only)
    dp_impl: Literal["bucketed", "torch_ddp"] = "bucketed"
    zero: int = 0  # sharded DP (docs/dp.md): 0 replicated, 1 optimizer state, 2 + gradients, 3 + parameters (FSDP2)
    # zero 2/3, gradients over microbatches: shard (reduce-scatter each), full (once per step) or auto (docs/dp.md)
    zero_accumulate: Literal["auto", "shard", "full"] = "auto"
    # zero 3 frees a block's gathered parameters after each use (always), keeps them for the step (never), or auto
    # (docs/dp.md)
    zero3_reshard: Literal["auto", "always", "never"] = "auto"
    # --- EP overlap ---
    # EP: each MoE layer's local experts run in ep_chunks groups, one group's all-to-alls travelling while another
    # computes
    ep_overlap: bool = False
    # EP: a microbatch's forward runs beside another's backward, each hiding the other's all-to-alls (docs/ep.md)
    ep_overlap_microbatches: bool = False
    ep_chunks: int = 2  # with ep_overlap: groups of local experts per layer call (docs/config.md)
    # EP dispatch: dynamic reads each call's split sizes to the host; static sends fixed-size buffers, no host read,
    # replaying a step whose buffers overflow (docs/ep.md)
    ep_dispatch: Literal["dynamic", "static"] = "dynamic"
    ep_capacity: float = 1.25  # with static: each peer's buffer, in multiples of its expected share (docs/ep.md)
    # with train.fp8: the EP dispatch sends each row's FP8 bits and scale, the experts' forward operand, and zero 3
    # all-gathers the FP8 weights as their forward operands (docs/fp8.md)
    fp8_comm: bool = False
    # dtype of the DP gradient reduction: fp32, or bf16 (half the bytes, each sum rounded; docs/precision.md)
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    # EP: static puts expert e on EP rank e // (E/EP); balanced places the experts by their routed load (docs/ep.md)
    expert_placement: Literal["static", "balanced"] = "static"
    rebalance_every: int = 10  # with balanced: steps per routing-count window (docs/config.md)
    expert_replicas: int = 1  # with balanced: ranks a hot expert may be replicated on (docs/config.md)
    # --- process groups and the planner ---
    timeout_s: float = 300.0  # process-group timeout
    check_replicas: bool = False  # debug: checksum all-reduce proving replicas are identical
    auto: bool = False  # choose dp/pp/ep/schedule/M/m with the planner (nanotitan plan) for the world size
    world: int = 0  # ranks for parallel.auto: 0 = WORLD_SIZE under torchrun, else dp*pp*ep*tp*cp
    # --- network emulation ---
    # hold every collective to this hardware profile's network (h100-sxm, ... or a JSON file; empty = off;
    # docs/emulate.md)
    emulate: str = ""
    emulate_node_size: int = 0  # ranks per emulated node, filled in rank order (0 = the profile's devices_per_node)
    emulate_dilation: float = 0.0  # emulated seconds = modelled seconds / dilation (docs/config.md)


def virtual_stages(schedule: str, pp: int, V: int) -> int:
    """Model chunks per pipeline rank: V (parallel.virtual_stages) under the interleaved schedule with pp > 1, else 1
    (every other schedule, and none without a pipeline, runs one chunk). The rule's one home (parallel/pp/facts.py
    re-exports it)."""
    return V if schedule == "interleaved" and pp > 1 else 1


@dataclass(kw_only=True)
class RunConfig:
    dir: str = "runs/default"  # run directory: metrics.jsonl, config.toml, summary.json, checkpoints, tb/
    overwrite: bool = False  # a run that does not resume run.dir's own checkpoints deletes them (docs/config.md)
    log_every: int = 10  # steps between records in metrics.jsonl
    peak_every: int = 10  # how often the memory meters run, in logged steps; 0: never (docs/config.md)
    tensorboard: bool = True  # also write TensorBoard events to run.dir/tb
    progress: bool = True  # rich progress bar on rank 0
    profile_steps: str = ""  # "A-B": torch.profiler traces of steps A..B to run.dir/profile (empty = off)
    wandb: bool = False  # also log metrics and the config to Weights & Biases (pip install 'nanotitan[wandb]')
    wandb_project: str = "nanotitan"  # W&B project of the run (with run.wandb)


@dataclass(kw_only=True)
class InitConfig:
    from_hf: str = ""  # transformers checkpoint dir (config.json + safetensors + tokenizer.json) (docs/config.md)


@dataclass(kw_only=True)
class ElasticConfig:
    """`nanotitan train --elastic.*`: this process is its node's agent in a job whose nodes may join and leave
    (docs/elastic.md); torchrun's meanings. Off while endpoint is empty."""
    nodes: str = ""  # "MIN:MAX" (or "N"): the job runs while at least MIN nodes are up and takes up to MAX
    nproc_per_node: int = 1  # ranks each node starts
    endpoint: str = ""  # HOST:PORT of node 0, which hosts the membership store (node 0 is the one at HOST)
    id: str = "nanotitan"  # job id: the nodes of one job share it (several jobs may share an endpoint host)
    join_timeout_s: float = 120.0  # a node waits this long for node 0's store, node 0 this long for MIN nodes
    silent_s: float = 4.0  # a node silent this long on its liveness connection is lost (>= 1: beats every 0.25 s)
    snapshot_every: int = 10  # K: every K steps a snapshot (a verified checkpoint) to snapshot_dir (docs/config.md)
    snapshot_dir: str = "/dev/shm"  # where each node keeps snapshots (its own dir: ID-RUNHASH-nodeI) (docs/config.md)
    secret_file: str = ""  # the job secret, the same file on every node (or $NANOTITAN_ELASTIC_SECRET) (docs/config.md)
    insecure: bool = False  # true: a job across hosts runs without a secret (docs/config.md)


@dataclass(kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)
    init: InitConfig = field(default_factory=InitConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)

    def __post_init__(self) -> None:
        # Where the values stand: plain attributes, not dataclass fields, so asdict, to_toml and == ignore them
        # (dataclasses.replace starts them afresh). `explicit`: the keys set in the file or on the command line, as
        # "section.key" (None: a Config built in code), which tell resolve.py which model keys init.from_hf may
        # fill and which it must refuse to change. `resolved`: resolve.py made every value concrete (its copy).
        self.explicit: frozenset[str] | None = None
        self.resolved = False

    @property
    def data_world(self) -> int:
        return self.parallel.dp * self.parallel.ep

    @property
    def layout_batch(self) -> int:
        """B = DP * EP * M * m sequences per step, as the layout implies (train.global_batch pins it)."""
        return self.data_world * self.parallel.microbatches * self.train.micro_batch

    @property
    def world_size(self) -> int:
        return self.parallel.dp * self.parallel.pp * self.parallel.ep * self.parallel.cp * self.parallel.tp


SECTIONS = {f.name: f.type for f in fields(Config)}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- TOML file <- CLI overrides, then validate(). An error about a value from the file names the file.
    The config as written: "auto" values, model.vocab_size 0 and init.from_hf are left for resolve.py, which
    turns them into the concrete config a job runs (and validates that one)."""
    cfg = Config()
    from_file: set[str] = set()  # "section.key" set by the file and not overridden on the command line
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} {'is not a file' if p.exists() else 'does not exist'} (--config PATH)")
        try:
            data = tomllib.loads(p.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {p} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
        for section, body in data.items():
            if not isinstance(body, dict):
                raise ConfigError(f"{p}: top-level key {section!r} must be a [section] table")
            for key, value in body.items():
                set_value(cfg, section, key, value, where=str(p))
                from_file.add(f"{section}.{key}")
    for section, key, value in parse_overrides(overrides or []):
        set_value(cfg, section, key, value)
        from_file.discard(f"{section}.{key}")
    if isinstance(cfg.parallel.pp_layers, list):  # layer counts read as floats (halves allowed): 2, not 2.0
        cfg.parallel.pp_layers = tidy_counts(cfg.parallel.pp_layers)
    cfg.explicit = frozenset(from_file | {f"{s}.{k}" for s, k, _ in parse_overrides(overrides or [])})
    if cfg.init.from_hf:
        # The model keys are init.from_hf's, known once resolve.py has read its config.json: checked there.
        return cfg
    try:
        validate(cfg)
    except ConfigError as e:
        # Blamed on the file when the key the line is about (the first it names) is the file's, or is a default set
        # against one of the file's; a value from the command line is the command line's (its flag is in the line).
        named = [m.group(0) for m in re.finditer(rf"(?<![\w.])(?:{'|'.join(SECTIONS)})\.\w+", str(e))]
        if named and named[0] not in cfg.explicit - from_file and any(k in from_file for k in named):
            raise ConfigError(f"{path}: {e}") from None  # the flag it names still overrides the file
        raise
    return cfg


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Every impossible value fails here, with one line naming the field and the fix, section by section. Reads,
    never writes: what is derived (model.vocab_size 0, pp_layers auto, ...) is resolve.py's."""
    # each axis's own rules before the experts' fold over three of them: a TP degree the heads refuse names the heads
    for check in (_check_finite, _check_ranges, check_run, _check_model, _check_pipeline, _check_dp_ep, check_tp,
                  check_cp, check_expert_fold, check_placement, check_elastic, check_controls,
                  check_dispatch, check_graphs, check_fp8, check_packed):
        check(cfg)
    if world_size is not None:
        p = cfg.parallel
        _check(world_size == cfg.world_size,
               f"world size {world_size} != parallel.dp*pp*ep*cp*tp = {p.dp}*{p.pp}*{p.ep}*{p.cp}*{p.tp} = "
               f"{cfg.world_size} (set --parallel.dp/pp/ep/cp/tp so their product is {world_size})")


def _check_finite(cfg: Config) -> None:
    """Floats are finite everywhere: nan slips through every comparison below, and inf trains NaN (lr inf)."""
    for section in SECTIONS:
        for f in fields(getattr(cfg, section)):
            v = getattr(getattr(cfg, section), f.name)
            _check(not isinstance(v, float) or math.isfinite(v),
                   f"{section}.{f.name}={v} must be a finite number (--{section}.{f.name})")


def _check_ranges(cfg: Config) -> None:
    """Sizes, counts and rates inside their ranges."""
    m, t, p, d = cfg.model, cfg.train, cfg.parallel, cfg.data
    _check(d.vocab_size >= 260, f"data.vocab_size={d.vocab_size} must be >= 260 for byte-level BPE (--data.vocab_size)")
    _check(not (why := vocab_too_large(cfg)), why)  # with the GiB it would take (fits.py)
    _check(m.vocab_size >= 0, f"model.vocab_size={m.vocab_size} must be >= 0 (--model.vocab_size, 0 = data.vocab_size)")
    for name, v in [("model.d_model", m.d_model), ("model.n_layers", m.n_layers), ("model.n_heads", m.n_heads),
                    ("model.ffn_dim", m.ffn_dim), ("model.num_experts", m.num_experts), ("model.top_k", m.top_k),
                    ("model.moe_every", m.moe_every), ("model.max_seq_len", m.max_seq_len),
                    ("data.shuffle_buffer", d.shuffle_buffer), ("train.micro_batch", t.micro_batch),
                    ("train.seq_len", t.seq_len), ("parallel.dp", p.dp), ("parallel.pp", p.pp), ("parallel.ep", p.ep),
                    ("parallel.tp", p.tp), ("parallel.cp", p.cp), ("parallel.microbatches", p.microbatches),
                    ("run.log_every", cfg.run.log_every),
                    ("train.max_skips", t.max_skips), ("train.muon_ns_steps", t.muon_ns_steps)]:
        _check(v >= 1, f"{name}={v} must be >= 1 (--{name})")
    for name, v in [("train.steps", t.steps), ("train.seed", t.seed), ("train.warmup_steps", t.warmup_steps),
                    ("run.peak_every", cfg.run.peak_every),
                    ("train.weight_decay", t.weight_decay), ("train.grad_clip", t.grad_clip),
                    ("train.qk_clip", t.qk_clip), ("train.global_batch", t.global_batch),
                    ("train.eval_every", t.eval_every), ("train.eval_batches", t.eval_batches),
                    ("train.ckpt_every", t.ckpt_every), ("train.keep_last", t.keep_last),
                    ("train.max_restarts", t.max_restarts), ("train.threads", t.threads),
                    ("train.peak_flops", t.peak_flops), ("train.sample_tokens", t.sample_tokens),
                    ("model.aux_coef", m.aux_coef), ("model.z_loss_coef", m.z_loss_coef),
                    ("model.bias_update_rate", m.bias_update_rate), ("model.capacity_factor", m.capacity_factor),
                    ("data.max_docs", d.max_docs), ("parallel.world", p.world),
                    ("parallel.emulate_node_size", p.emulate_node_size),
                    ("parallel.emulate_dilation", p.emulate_dilation)]:
        _check(v >= 0, f"{name}={v} must be >= 0 (--{name})")
    for name, v in [("train.lr", t.lr), ("train.muon_lr", t.muon_lr), ("train.muon_adamw_lr", t.muon_adamw_lr),
                    ("model.rope_theta", m.rope_theta), ("model.norm_eps", m.norm_eps),
                    ("model.routed_scale", m.routed_scale),
                    ("model.init_std", m.init_std), ("parallel.bucket_mb", p.bucket_mb)]:
        _check(v > 0, f"{name}={v} must be > 0 (--{name})")
    for name, v in [("train.beta1", t.beta1), ("train.beta2", t.beta2), ("train.muon_momentum", t.muon_momentum)]:
        _check(0.0 <= v < 1.0, f"{name}={v} must be in [0, 1) (--{name})")
    _check(t.seed < 2**63, f"train.seed={t.seed} must be < 2**63 (--train.seed)")
    _check(not t.qk_clip or m.qk_norm == "none", f"train.qk_clip={t.qk_clip} needs model.qk_norm none: a normalised "
           f"q or k ignores its weights' scale (--train.qk_clip 0, or --model.qk_norm none)")


def _check_model(cfg: Config) -> None:
    """The model's shape: heads, layers, experts, position table, vocabulary."""
    m, t, d = cfg.model, cfg.train, cfg.data
    for name, v in [("model.n_kv_heads", m.n_kv_heads), ("model.head_dim", m.head_dim),
                    ("model.first_k_dense", m.first_k_dense), ("model.dense_ffn_dim", m.dense_ffn_dim),
                    ("model.shared_experts", m.shared_experts), ("model.shared_ffn_dim", m.shared_ffn_dim),
                    ("model.q_lora_rank", m.q_lora_rank), ("model.kv_lora_rank", m.kv_lora_rank),
                    ("model.qk_nope_head_dim", m.qk_nope_head_dim), ("model.qk_rope_head_dim", m.qk_rope_head_dim),
                    ("model.v_head_dim", m.v_head_dim), ("model.rope_original_max_len", m.rope_original_max_len),
                    ("model.mtp_layers", m.mtp_layers)]:
        _check(v >= 0, f"{name}={v} must be >= 0 (--{name})")
    if m.kv_lora_rank:  # MLA: the per-head widths replace head_dim
        _check(m.qk_rope_head_dim > 0 and m.qk_rope_head_dim % 2 == 0 and m.v_head_dim > 0,
               f"model.kv_lora_rank={m.kv_lora_rank} (MLA) needs an even model.qk_rope_head_dim > 0 and "
               "model.v_head_dim > 0 (--model.qk_rope_head_dim 16 --model.v_head_dim 32)")
        _check(m.pos_emb == "rope", f"model.kv_lora_rank={m.kv_lora_rank} (MLA) needs model.pos_emb=rope")
    _check(m.n_group >= 1 and m.num_experts % m.n_group == 0,
           f"model.n_group={m.n_group} must be >= 1 and divide model.num_experts={m.num_experts} (--model.n_group)")
    _check(1 <= m.topk_group <= m.n_group,
           f"model.topk_group={m.topk_group} must be in [1, model.n_group={m.n_group}] (--model.topk_group)")
    _check(m.n_group == 1 or m.top_k <= m.topk_group * (m.num_experts // m.n_group),
           f"model.top_k={m.top_k} exceeds the experts of model.topk_group={m.topk_group} groups of "
           f"{m.num_experts // m.n_group} (--model.topk_group)")
    _check(m.rope_scaling == "none" or m.rope_factor >= 1.0,
           f"model.rope_factor={m.rope_factor} must be >= 1 with model.rope_scaling=yarn (--model.rope_factor)")
    _check(m.mtp_coef >= 0, f"model.mtp_coef={m.mtp_coef} must be >= 0 (--model.mtp_coef)")
    _check(m.mtp_layers < t.seq_len, f"model.mtp_layers={m.mtp_layers} must be < train.seq_len={t.seq_len}: depth k "
           "predicts k + 1 tokens ahead (--model.mtp_layers)")
    _check(m.head_dim > 0 or m.d_model % m.n_heads == 0 or m.kv_lora_rank > 0,
           f"model.n_heads={m.n_heads} must divide model.d_model={m.d_model} "
           "(--model.n_heads, or set --model.head_dim)")
    head_dim = m.head_dim or m.d_model // m.n_heads
    _check(m.pos_emb != "rope" or head_dim % 2 == 0 or m.kv_lora_rank > 0,
           f"rope needs an even head dim, got {head_dim} (--model.head_dim, or --model.pos_emb learned)")
    _check(m.n_heads % (m.n_kv_heads or m.n_heads) == 0,
           f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads} (--model.n_kv_heads, 0 = n_heads)")
    _check(all(0 <= i < m.n_layers for i in m.dense_layers),
           f"model.dense_layers={m.dense_layers} must be layer indices in [0, {m.n_layers}) (--model.dense_layers 0,2)")
    _check(m.first_k_dense <= m.n_layers,
           f"model.first_k_dense={m.first_k_dense} exceeds model.n_layers={m.n_layers} (--model.first_k_dense)")
    _check(not m.shared_expert_gate or m.shared_experts > 0,
           "model.shared_expert_gate=true gates nothing without shared experts (--model.shared_experts 1)")
    _check(m.top_k <= m.num_experts,
           f"model.top_k={m.top_k} must be <= model.num_experts={m.num_experts} (--model.top_k)")
    # Both position schemes are tables of max_seq_len rows (learned embeddings, or the rope cos/sin cache).
    _check(t.seq_len <= m.max_seq_len,
           f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}, the size of the {m.pos_emb} "
           f"position table (--model.max_seq_len {t.seq_len})")
    _check(m.vocab_size == 0 or bool(d.tokenizer) or m.vocab_size >= d.vocab_size,
           f"model.vocab_size={m.vocab_size} < data.vocab_size={d.vocab_size}, the trained BPE's size "
           "(--model.vocab_size 0 takes the data's)")


def _check_pipeline(cfg: Config) -> None:
    """The layout over the model: EP over experts, stages and chunks over layers, FSDP2 under PP."""
    m, p = cfg.model, cfg.parallel
    _check(m.num_experts % p.ep == 0,
           f"parallel.ep={p.ep} must divide model.num_experts={m.num_experts} (--parallel.ep)")
    _check(p.pp <= m.n_layers,
           f"parallel.pp={p.pp} stages need at least as many layers, model.n_layers={m.n_layers} (--parallel.pp)")
    _check(p.virtual_stages >= 1,
           f"parallel.virtual_stages={p.virtual_stages} must be >= 1 (--parallel.virtual_stages)")
    _check(p.virtual_stages == 1 or p.schedule == "interleaved",
           f"parallel.virtual_stages={p.virtual_stages} needs --parallel.schedule interleaved "
           "(or --parallel.virtual_stages 1)")
    interleaved = p.pp > 1 and p.schedule == "interleaved"
    n_chunks = p.pp * virtual_stages(p.schedule, p.pp, p.virtual_stages)
    if interleaved:
        _check(n_chunks <= m.n_layers,
               f"parallel.pp*virtual_stages={p.pp}*{p.virtual_stages} chunks need at least as many layers, "
               f"model.n_layers={m.n_layers} (--parallel.virtual_stages)")
        # Megatron's interleaved schedule runs the microbatches in groups of pp through each chunk in turn.
        _check(p.auto or p.microbatches % p.pp == 0,
               f"parallel.schedule=interleaved needs parallel.microbatches={p.microbatches} to be a multiple of "
               f"parallel.pp={p.pp} (--parallel.microbatches {p.pp * max(1, -(-p.microbatches // p.pp))})")
    if p.pp_layers and p.pp_layers != "auto":
        _check(len(p.pp_layers) == n_chunks and all(n >= 0.5 and float(2 * n).is_integer() for n in p.pp_layers)
               and sum(p.pp_layers) == m.n_layers,
               f"parallel.pp_layers={p.pp_layers} must list {n_chunks} counts, each a positive multiple of 0.5 "
               f"(x.5 cuts a block between its attention and its FFN), summing to model.n_layers={m.n_layers} "
               f"(--parallel.pp_layers {','.join(['1'] * n_chunks)}, or auto)")
    # FSDP2 reduce-scatters a block's gradients when its input gradient is done (before zb1's deferred weight
    # gradients) and all-gathers on the root module's forward (which the interleaved chunks never call).
    _check(p.zero < 3 or p.pp == 1 or p.schedule in ("gpipe", "1f1b"),
           f"parallel.zero=3 (FSDP2) runs with the gpipe and 1f1b schedules, not {p.schedule} "
           "(--parallel.zero 2, or --parallel.schedule 1f1b)")


def _check_dp_ep(cfg: Config) -> None:
    """The DP flavour, EP overlap and lanes, zero levels, network emulation and the global batch."""
    m, t, p, d = cfg.model, cfg.train, cfg.parallel, cfg.data
    _check(p.dp_impl == "bucketed" or (p.pp == 1 and p.ep == 1),
           "parallel.dp_impl=torch_ddp supports pure DP only (pp=1, ep=1); use --parallel.dp_impl bucketed")
    _check(p.ep_chunks >= 2, f"parallel.ep_chunks={p.ep_chunks} must be >= 2: the groups a trip is pipelined in "
           "(--parallel.ep_chunks 2)")
    moe_ep = expert_ranks(p.ep, p.cp, p.tp)  # the experts fold over EP x CP x TP (parallel/tp.py, parallel/cp.py)
    _check(not p.ep_overlap or moe_ep == 1 or p.auto or m.num_experts // moe_ep >= 2,
           f"parallel.ep_overlap pipelines groups of an EP rank's experts, and model.num_experts/(parallel.ep*cp*tp) = "
           f"{m.num_experts}/{moe_ep} leaves one (--parallel.ep {p.ep // 2 or 1}, or --parallel.ep_overlap false)")
    if p.ep_overlap_microbatches:  # two lanes: a forward beside a backward (parallel/pp/schedules.py, docs/ep.md)
        off = "--parallel.ep_overlap_microbatches false"
        _check(p.auto or p.ep > 1, f"parallel.ep_overlap_microbatches hides EP all-to-alls, and parallel.ep=1 has "
                                   f"none (--parallel.ep 2, or {off})")
        _check(p.auto or p.microbatches >= 2, f"parallel.ep_overlap_microbatches runs one microbatch's forward beside "
                                              f"another's backward: parallel.microbatches={p.microbatches} must be "
                                              f">= 2 (--parallel.microbatches 4, or {off})")
        _check(p.zero < 3, f"parallel.ep_overlap_microbatches runs with zero 0-2: FSDP2's hooks (zero 3) are not safe "
                           f"in two threads at once (--parallel.zero 2, or {off})")
        _check(t.device != "cuda", f"parallel.ep_overlap_microbatches runs on CPU (gloo) only: on CUDA each lane "
                                   f"needs its own stream, not built yet (docs/ep.md) (--train.device cpu, or {off})")
    _check(p.zero in (0, 1, 2, 3), f"parallel.zero={p.zero} must be 0, 1, 2 or 3 (--parallel.zero)")
    for name, ok in (("zero_accumulate", ("auto", "shard", "full")), ("zero3_reshard", ("auto", "always", "never"))):
        v = getattr(p, name)
        _check(v in ok, f"parallel.{name}={v!r} must be {', '.join(ok[:-1])} or {ok[-1]} (--parallel.{name})")
    _check(p.zero == 0 or p.dp_impl == "bucketed",
           f"parallel.zero={p.zero} shards our own DP; torch DDP replicates "
           "(--parallel.dp_impl bucketed or --parallel.zero 0)")
    _check(p.zero < 3 or not p.check_replicas,
           "parallel.check_replicas compares replicas, and zero 3 keeps none "
           "(--parallel.check_replicas false or --parallel.zero 2)")
    _check(p.reduce_dtype == "fp32" or (p.dp_impl == "bucketed" and p.zero < 3),
           f"parallel.reduce_dtype=bf16 is implemented by the bucketed Reducer (zero 0-2), not by "
           f"{'torch DDP' if p.dp_impl == 'torch_ddp' else 'zero 3'} (--parallel.reduce_dtype fp32)")
    _check(p.zero == 0 or p.auto or p.dp * p.ep > 1,
           f"parallel.zero={p.zero} shards over dp*ep ranks, here 1: nothing to shard "
           "(--parallel.zero 0, or dp/ep > 1)")
    _check(d.loader == "indexed" or t.resume in ("", "never"),
           "data.loader=streaming cannot resume by step; use --data.loader indexed to resume")
    _check(bool(p.emulate) or not (p.emulate_node_size or p.emulate_dilation),
           "parallel.emulate_node_size/emulate_dilation shape a network emulation, which is off "
           "(--parallel.emulate h100-sxm, or leave them 0)")
    _check(not p.emulate or t.device != "cuda", "parallel.emulate holds the calling thread, which NCCL's asynchronous "
           "collectives do not wait for: emulate on CPU (--train.device cpu)")
    _check(not t.global_batch or p.auto or t.global_batch == cfg.layout_batch,
           f"train.global_batch={t.global_batch} != dp*ep*microbatches*micro_batch = {cfg.layout_batch} "
           "(fix the layout, set --train.global_batch 0, or let --parallel.auto true choose M and m)")


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (written to RUN_DIR/config.toml)."""
    lines = []
    for section, body in to_dict(cfg).items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in body.items()] + [""]
    return "\n".join(lines)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):  # pp_layers' numbers, train.fp8_skip's patterns
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)
