"""What `--train.fp8` does to a step's compute, as the planner prices it (docs/planner.md "FP8").

The FP8 GEMMs (model/fp8.py, the default `train.fp8_skip`) are the attention and MLA projections but q_a and kv_a,
the dense FFNs, the shared experts and the routed experts; the attention scores, the router, the embedding and the
head stay in bf16. A layer's dense FLOPs are therefore a mix, priced as a harmonic mean of the two rates:

    s/FLOP (dense)  = a * (1/P8 + cast) + (1 - a) / P16        a: the FP8 share of the layers' dense FLOPs
    s/FLOP (expert) = (2/P8 + 1/P16) / 3 + cast                  our experts keep the weight gradient in bf16

P8 is the profile's dense FP8 rate, `Hardware.peak_flops_fp8`, or at mxfp8 its MXFP8 rate, `peak_flops_mxfp8`
(Blackwell; none on Hopper: refused); a CPU emulates both (torch's `_scaled_mm`, torchao's EMULATED MXFP8:
dequantize, then an fp32 matmul, 1.5-2x the fp32 time, EMULATED_SLOWDOWN). `cast` is the casts'
memory traffic per FLOP: each cast reads its bf16 operand twice (amax, then scale and round) and writes one byte,
5 bytes an element; rowwise casts an operand again along the other axis for the backward (2 casts of each of a
GEMM's 3 operands over its 3 GEMMs), tensorwise once. For a (T x K) @ (K x N) GEMM that is
casts * 5 * (TK + KN + TN) / (3 * 2TKN) bytes per FLOP of a pass, over the profile's memory bandwidth.
"""

from __future__ import annotations

import functools

from ..config.config import Config, ConfigError
from ..config.counts import attention_matmuls, mla
from ..config.hardware import BUILTIN, Hardware

CAST_BYTES = 5  # per element: the amax pass reads 2, the cast reads 2 and writes 1
# casts of each operand over a GEMM's forward and two backward GEMMs (mxfp8: along each of its two axes, as rowwise)
CASTS = {"rowwise": 2, "tensorwise": 1, "mxfp8": 2}
EMULATED_SLOWDOWN = 1.75  # CPU: torch._scaled_mm is dequantize + an fp32 matmul, 1.5-2x the fp32 GEMM


def fp8_peak(hw: Hardware, ranks_on_node: int, recipe: str = "rowwise") -> float:
    """The FP8 GEMM rate of one rank at `recipe`: the tensor cores' (mxfp8: the block-scaled MXFP8 ones), or on a
    CPU the emulation's; a GPU without those units is refused in one line."""
    mx = recipe == "mxfp8"
    peak = hw.peak_flops_mxfp8 if mx else hw.peak_flops_fp8
    if peak:
        return peak
    if hw.cores_per_node:
        return hw.peak_flops("fp32", ranks_on_node) / EMULATED_SLOWDOWN
    units = "MXFP8" if mx else "FP8"
    gpus = ", ".join(n for n, h in BUILTIN.items() if (h.peak_flops_mxfp8 if mx else h.peak_flops_fp8))
    fix = "rowwise (Hopper's FP8) or off" if mx and hw.peak_flops_fp8 else "off"
    raise ConfigError(f"train.fp8: {hw.name} has no {units} tensor cores (peak_flops_{units.lower()} 0); plan it "
                      f"with --train.fp8 {fix}, or on a GPU with them ({gpus})")


def _fp8_weights(shape, i: int) -> float:
    """Layer i's weights that FP8 GEMMs multiply: its attention projections but MLA's q_a and kv_a, its dense FFN or
    shared experts; not its norms or router (a shared-expert gate's D weights count: negligible)."""
    D = shape.d_model
    matmuls, _ = attention_matmuls(shape)
    small = D * shape.q_lora_rank + D * (shape.kv_lora_rank + shape.qk_rope_head_dim) if mla(shape) else 0
    ffn = shape.layer_params(i)[0] - shape.attn_part(i)["params"]  # its norm, the dense FFN or router and shared
    return matmuls - small + ffn - D - (D * shape.num_experts if shape.is_moe(i) else 0)


@functools.lru_cache(maxsize=64)  # per model shape, asked once per layout the search predicts
def dense_fp8_share(shape) -> float:
    """The FP8 GEMMs' share of the layers' dense forward FLOPs (plan/shape.py `layer_fwd_flops`): 2 a weight."""
    fp8 = sum(2 * _fp8_weights(shape, i) for i in range(shape.n_layers))
    total = sum(shape.layer_fwd_flops(i)[0] for i in range(shape.n_layers))
    return fp8 / total if total else 0.0


def wire_bytes(recipe: str, width: int) -> float:
    """Bytes an FP8 row of `width` elements costs on the wire with its scale (parallel/ep.py, parallel/dp/
    fp8_gather.py): one byte an element, and the scale: rowwise a power of 2 sent as its exponent byte, tensorwise an
    fp32, MXFP8 one e8m0 byte per 32 elements."""
    return width + {"rowwise": 1.0, "tensorwise": 4.0}.get(recipe, width / 32)


def ep_wire_ratio(cfg: Config, d_model: int, act_bytes: float) -> float:
    """The EP all-to-all's mean payload per trip under parallel.fp8_comm, against `act_bytes` an element: the
    dispatch's forward trip and the combine's gradient trip carry FP8 rows with their scales, the combine's forward
    trip and the dispatch's gradient trip stay in high precision (4 trips a MoE layer). 1 without it."""
    if not cfg.parallel.fp8_comm or cfg.train.fp8 == "off":
        return 1.0
    return (2 + 2 * wire_bytes(cfg.train.fp8, d_model) / (d_model * act_bytes)) / 4


def gather_ratios(cfg: Config, shape, param_bytes: float, zero: int) -> tuple[float, float]:
    """(non-expert, expert) ZeRO-3 all-gather bytes per parameter under parallel.fp8_comm, against `param_bytes`:
    the weights of FP8 GEMMs travel as their forward operand (one byte an element, the scales negligible beside
    them), the rest (norms, router, embedding, head, the skipped projections) as parameters. (1, 1) without it or
    below zero 3 (`zero`: the layout's level, which a search varies)."""
    if not cfg.parallel.fp8_comm or cfg.train.fp8 == "off" or zero != 3:
        return 1.0, 1.0
    share = fp8_param_share(shape)
    return share / param_bytes + (1 - share), 1 / param_bytes


@functools.lru_cache(maxsize=64)
def fp8_param_share(shape) -> float:
    """The FP8 GEMMs' share of the non-expert parameters (`_fp8_weights`; the embedding and head count as the rest)."""
    total = sum(shape.layer_params(i)[0] for i in range(shape.n_layers)) + 2 * shape.vocab * shape.d_model
    return sum(_fp8_weights(shape, i) for i in range(shape.n_layers)) / total if total else 0.0


def cast_s_per_flop(hw: Hardware, recipe: str, T: float, K: float, N: float) -> float:
    """Seconds of cast traffic per FLOP of one pass of a (T x K) @ (K x N) GEMM (module docstring)."""
    return CASTS[recipe] * CAST_BYTES * (1 / N + 1 / K + 1 / max(T, 1.0)) / 6 / hw.mem_bw


def gemm_rates(cfg: Config, shape, hw: Hardware, peak: float, T: float, t_expert: float, ranks_on_node: int,
               eff_dense: float, eff_expert: float) -> tuple[float, float]:
    """(dense, expert) FLOP/s that `c.T * flops / (rate * eff)` turns into seconds: `peak` both without FP8; with
    it, the module docstring's mixes, the casts' seconds folded in (they do not scale with GEMM efficiency). T: the
    rank's tokens a microbatch, t_expert: an expert's."""
    recipe = cfg.train.fp8
    if recipe == "off":
        return peak, peak
    p8, D, F = fp8_peak(hw, ranks_on_node, recipe), shape.d_model, shape.ffn_dim
    a = dense_fp8_share(shape)
    s_dense = a * (1 / p8 + cast_s_per_flop(hw, recipe, T, D, D) * eff_dense) + (1 - a) / peak
    s_expert = (2 / p8 + 1 / peak) / 3 + cast_s_per_flop(hw, recipe, t_expert, D, F) * eff_expert
    return 1 / s_dense, 1 / s_expert
