"""FP8 training (train.fp8, docs/fp8.md): dynamic scaling, e4m3 forward, the recipe's dtype for gradients.

Two kinds of GEMM, two sources:
- the dense projections (attention, MLA, dense FFNs, shared experts, MTP's eh_proj): torchao's float8 linear,
  the GEMMs of the autograd function Float8Linear itself calls (`matmul_with_hp_or_float8_args`, as
  `Float8Matmul`) with torchao's recipe (Float8LinearConfig.from_recipe_name): its casts, its scales, its
  `torch._scaled_mm` (which runs on CPU too). Each scale is one microbatch's: a layout that runs a microbatch's
  tokens whole on a rank (DP, ZeRO, EP's dense part, PP) computes one process's scales as it is; TP and CP cut a
  linear's dims over ranks, and each cast reduces its amax over the ranks holding the dims its scale spans
  (`Split`, set by parallel/tp.py and parallel/cp.py), so the bits are one process's there too.
- the routed experts (`ExpertsMM`): written here. torchao's grouped float8 op is CUDA only, and its weight
  gradient scales each expert's columns over that expert's tokens of the call, which under EP are tokens of
  several ranks' microbatches: a per-layout quantity. So the experts scale what is the same in every layout:
  each assignment's row (its own amax), each expert's weight per output column (rowwise) or whole (tensorwise),
  and keep the weight gradient in high precision (torchao's rowwise_with_gw_hp choice). The GEMM is
  one `torch._scaled_grouped_mm` launch for all of a rank's experts on a GPU (`grouped_mm`), and on CPU, which
  has no kernel for it, `torch._scaled_mm` per expert group, fp32 accumulate: bitwise the dequantized fp32
  matmul.

train.fp8 mxfp8 (blocks of 32 with e8m0 scales, torchao's MXFP8 ops) is model/mxfp8.py's; `linear` and `experts`
hand it over.

`convert` marks the modules: a Linear gets `.fp8`, an ExpertFFN its `.fp8`; train.fp8_skip's patterns keep some in
high precision (fnmatch on the qualified name or its last component; the defaults and why: config/fp8_rules.py).
Parameters stay fp32 masters: checkpoints, optimizers and gradient syncs see no difference.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from . import mxfp8
from .fp8_weight import operand

RECIPES = ("tensorwise", "rowwise", "mxfp8")


@dataclass(frozen=True)
class Fp8:
    """One recipe, as torchao defines it: the linears' config, and what the experts take from it."""
    recipe: str
    config: object  # torchao.float8.Float8LinearConfig
    mm_config: object  # torchao.float8.float8_training_tensor.LinearMMConfig
    wire: bool = False  # parallel.fp8_comm: the experts' input is its FP8 operand (bits, scales), as on the wire

    @property
    def forward_dtype(self) -> torch.dtype:
        return self.config.cast_config_input.target_dtype

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.config.cast_config_grad_output.target_dtype

    @property
    def rowwise(self) -> bool:
        return self.recipe == "rowwise"

    @property
    def pow2(self) -> bool:
        return self.config.round_scales_to_power_of_2


def _import_torchao(*modules: str) -> None:
    """torchao's first import (and `modules` of it), quiet where its warnings say nothing to a user: its CUDA-only
    extensions' load failures on a CPU build (shown on a CUDA machine), and torch 2.13's deprecation of how
    torchao 0.18 registers an enum with torch.compile (its MX formats register another)."""
    import importlib
    import logging

    logs = [logging.getLogger("torch.utils._pytree")]
    logs += [] if torch.cuda.is_available() else [logging.getLogger("torchao")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        import torchao  # noqa: F401
        for module in modules:
            importlib.import_module(module)
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


def recipe(name: str, wire: bool = False) -> "Fp8 | mxfp8.Mxfp8 | None":
    """The Fp8 of train.fp8 `name` (None for "off"; mxfp8's recipe: model/mxfp8.py), `wire` parallel.fp8_comm's.
    torchao is imported only here: fp8 off never needs it."""
    if name == "off":
        return None
    if name == "mxfp8":
        _import_torchao(*mxfp8.TORCHAO_MODULES)
        return mxfp8.recipe()
    _import_torchao()
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

    assert name in RECIPES, name
    c = Float8LinearConfig.from_recipe_name(name)
    # Float8Linear.__init__'s three GEMM configs (output, grad_input, grad_weight), emulate off: torch._scaled_mm
    mm = LinearMMConfig(*(ScaledMMConfig(False, g.use_fast_accum, False, c.pad_inner_dim)
                          for g in (c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight)))
    return Fp8(name, c, mm, wire)


def skipped(qualname: str, patterns) -> bool:
    leaf = qualname.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(qualname, p) or fnmatch.fnmatchcase(leaf, p) for p in patterns)


def convert(model: nn.Module, fp8: Fp8 | None, skip) -> list[str]:
    """Mark every Linear and ExpertFFN of `model` whose name no `skip` pattern matches to run in `fp8` (None: all
    back to high precision). Returns the names converted."""
    done = []
    for name, m in model.named_modules():
        if hasattr(m, "fp8"):
            m.fp8 = None if fp8 is None or skipped(name, skip) else fp8
            if m.fp8 is not None:
                done.append(name)
    return done


Reduce = Callable[[torch.Tensor], torch.Tensor]  # an amax -> its MAX over the ranks that hold one dim's slices


@dataclass(frozen=True)
class Split:
    """Where a linear's GEMM dimensions are cut over ranks, set by the layout (parallel/tp.py, parallel/cp.py): the
    tokens T (CP's chunks; the tokens a TP rank routes or SP leaves it), the input features K (a row-parallel
    weight), the output features N (a column-parallel one). Each holds the MAX all-reduces over the ranks that hold
    that dim's slices (none: whole on this rank). A cast's amax is reduced over the dims its scale spans: every dim
    of the tensor at tensorwise, the scaled axis at rowwise, so each scale is the one process's (docs/fp8.md)."""
    tokens: tuple[Reduce, ...] = ()
    inner: tuple[Reduce, ...] = ()
    outer: tuple[Reduce, ...] = ()


WHOLE = Split()


def _cast(t: torch.Tensor, dims: tuple[tuple[Reduce, ...], tuple[Reduce, ...]], axis: int, cast, fp8: Fp8, role):
    """torchao's `hp_tensor_to_float8_dynamic` for the 2D `t` under `cast` (a CastConfig of the recipe), its amax
    reduced over the ranks holding slices of t's `dims` (per dim of t) that the scale spans: both (tensorwise) or
    `axis`'s (axiswise). Bitwise torchao's where nothing is split (a max is exact in any order and dtype)."""
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

    axis = get_maybe_axiswise_dim(axis, cast.scaling_granularity)
    amax = tensor_to_amax(t, False, None, cast.scaling_granularity, axis)
    for reduce in (r for d in (dims if axis is None else (dims[axis],)) for r in d):
        amax = reduce(amax.float())
    scale = amax_to_scale(amax, cast.target_dtype, round_scales_to_power_of_2=fp8.pow2)
    return hp_tensor_and_scale_to_float8(t, scale, cast.target_dtype, fp8.mm_config, role, axis)


def _mm(a, b) -> torch.Tensor:
    """torch.mm of two torchao float8 tensors (its `float8_mm`), save one thing: a rowwise GEMM in fp32 keeps its
    fp32 accumulate. torchao rounds that GEMM's output through bf16 (CUDA's rowwise kernel has no fp32 output), so
    a GEMM whose inner dim is split over ranks (a row-parallel weight under TP; a weight gradient over CP's tokens)
    would add bf16-rounded partials where one process rounds their sum once. Done as torchao's own unfused path
    does it: the GEMM at unit scales, fp32 out (which every kernel has), times the row and column inverse scales
    (powers of 2 at rowwise: exact), so it is bitwise the dequantized fp32 matmul."""
    from torchao.float8.float8_ops import preprocess_addmm

    if a._orig_dtype != torch.float32 or a._axiswise_dim is None or b._axiswise_dim is None:
        return torch.mm(a, b)
    a_data, a_scale, b_data, b_scale = preprocess_addmm(a, b)
    one = a_scale.new_ones(())
    y = torch._scaled_mm(a_data, b_data, scale_a=one, scale_b=one, out_dtype=torch.float32)
    return y * (a_scale.reciprocal() * b_scale.reciprocal())


class Float8Matmul(torch.autograd.Function):
    """x [T, K] @ w_t [K, N] in FP8: torchao's `matmul_with_hp_or_float8_args` (the function its Float8Linear calls:
    the same six casts, roles and GEMMs, every input in high precision), each cast's amax reduced over `split`
    (`_cast`): input (T, K), weight (K, N), grad output (T, N)."""

    @staticmethod
    def forward(ctx, x, w_t, fp8: Fp8, split: Split):
        from torchao.float8.float8_training_tensor import GemmInputRole as R

        ctx.save_for_backward(x, w_t)
        ctx.fp8, ctx.split = fp8, split
        c, s = fp8.config, split
        qx = _cast(x, (s.tokens, s.inner), -1, c.cast_config_input, fp8, R.INPUT)
        return _mm(qx, _weight(w_t, fp8, s))

    @staticmethod
    def backward(ctx, dy):
        from torchao.float8.float8_training_tensor import GemmInputRole as R

        x, w_t = ctx.saved_tensors
        c, s, f = ctx.fp8.config, ctx.split, ctx.fp8
        dy0 = _cast(dy, (s.tokens, s.outer), -1, c.cast_config_grad_output, f, R.GRAD_OUTPUT)
        w1 = _weight_for_grad_input(w_t, f, s) if f.wire else \
            _cast(w_t, (s.inner, s.outer), -1, c.cast_config_weight_for_grad_input, f, R.WEIGHT)
        dx = _mm(dy0, w1.t())
        dy1 = _cast(dy, (s.tokens, s.outer), 0, c.cast_config_grad_output_for_grad_weight, f, R.GRAD_OUTPUT)
        x1 = _cast(x, (s.tokens, s.inner), 0, c.cast_config_input_for_grad_weight, f, R.INPUT)
        dw = _mm(dy1.t(), x1)
        return dx, dw.t(), None, None


def _weight(w_t: torch.Tensor, fp8: Fp8, split: Split):
    """The forward GEMM's weight operand: the bits and scales an FP8 all-gather delivered (an `Fp8Weight`:
    parallel.fp8_comm under ZeRO-3, parallel/dp/fp8_gather.py, cast on the shards with these very scales), read as
    they are; else cast here."""
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole as R

    cast = fp8.config.cast_config_weight
    got = operand(w_t)
    if got is None:
        return _cast(w_t, (split.inner, split.outer), 0, cast, fp8, R.WEIGHT)
    axis = get_maybe_axiswise_dim(0, cast.scaling_granularity)
    return Float8TrainingTensor(got[0], got[1], w_t.dtype, fp8.mm_config, R.WEIGHT, axis)


def _weight_for_grad_input(w_t: torch.Tensor, fp8: Fp8, split: Split):
    """parallel.fp8_comm: the grad-input GEMM's weight operand made from the forward's, as a rank holds it that
    all-gathered the weight in FP8, in every layout (so one process computes what ZeRO-3 does). Tensorwise casts
    both the same way: the forward's bits. Rowwise scales the forward's per output feature and this one per input
    feature: the forward operand's values cast again, a second rounding, exact but for elements subnormal under
    one of the two power-of-2 scales (docs/fp8.md "FP8 weights on the wire")."""
    from torchao.float8.float8_training_tensor import GemmInputRole as R

    c, qw = fp8.config, _weight(w_t, fp8, split)
    if c.cast_config_weight_for_grad_input == c.cast_config_weight and qw._axiswise_dim is None:
        return qw
    values = dequantize(qw._data, qw._scale, w_t.dtype)  # e4m3 times a power of 2: exact in bf16 and fp32
    return _cast(values, (split.inner, split.outer), -1, c.cast_config_weight_for_grad_input, fp8, R.WEIGHT)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp8: Fp8,
           split: Split = WHOLE) -> torch.Tensor:
    """F.linear in FP8: torchao's Float8Linear.forward (its GEMMs and recipe: `Float8Matmul`), autocast honoured
    as there (the input cast to the autocast dtype; the weight too, so both GEMM operands share one dtype).
    mxfp8: torchao's MXFP8 linear (model/mxfp8.py), whose blocks need no amax over `split`'s ranks."""
    if isinstance(fp8, mxfp8.Mxfp8):
        return mxfp8.linear(x, weight, bias, fp8)
    dev = x.device.type
    lead = x.shape[:-1]
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        x, weight = x.to(dt), weight.to(dt)
        bias = None if bias is None else bias.to(dt)
        with torch.autocast(dev, enabled=False):
            y = Float8Matmul.apply(x.reshape(-1, x.shape[-1]), weight.t(), fp8, split)
    else:
        y = Float8Matmul.apply(x.reshape(-1, x.shape[-1]), weight.t(), fp8, split)
    y = y.reshape(*lead, y.shape[-1])
    return y if bias is None else y + bias.to(y.dtype)


def quantize(t: torch.Tensor, dtype: torch.dtype, dim: int | None, pow2: bool):
    """(bits, scale) of t in `dtype`, torchao's dynamic cast: scale = max(dtype) / amax over `dim` (None: the whole
    tensor; keepdim), in float64 then float32, rounded down to a power of 2 when the recipe says; saturated."""
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = amax_to_scale(amax.float(), dtype, pow2)
    return to_fp8_saturated(t.float() * scale, dtype), scale


def dequantize(bits: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values FP8 `bits` at `scale` stand for, in `dtype` (torchao's emulated GEMM reads them so)."""
    return (bits.float() / scale).to(dtype)


def scale_exponent(scale: torch.Tensor) -> torch.Tensor:
    """A power-of-2 scale 2^e as e in one byte (int8 holds every e an fp32 amax gives): how the rowwise recipe's
    scales travel (parallel/ep.py's FP8 trips, parallel/dp/fp8_gather.py's gathers)."""
    return (torch.frexp(scale).exponent - 1).to(torch.int8)


def exponent_scale(exponent: torch.Tensor) -> torch.Tensor:
    """The fp32 scale 2^e of `scale_exponent`'s byte e."""
    return torch.ldexp(torch.ones(exponent.shape, device=exponent.device), exponent.float())


E4M3 = torch.float8_e4m3fn
ALIGN_M = 16  # rows per group the GPU's grouped FP8 kernel is launched with (its TMA loads take 16-row tiles)


def grouped_mm(a_fp8: tuple[torch.Tensor, torch.Tensor], b_fp8: tuple[torch.Tensor, torch.Tensor],
               counts_L: list[int], out_dtype: torch.dtype) -> torch.Tensor:
    """y = a @ b[g] on each of L contiguous row groups of a (`counts_L` rows each), from FP8 operands: a's
    (bits [n, K], per-row scales [n, 1]) and b's (bits [L, K, N], scales [L, 1, N] per column or [L, 1, 1] whole),
    fp32 accumulate, out in `out_dtype`. On a GPU with both operands e4m3 and a bf16 output: one
    `torch._scaled_grouped_mm` launch (`grouped_launch`); elsewhere (a CPU, e5m2 gradients or an fp32 output, which
    that kernel does not take) `torch._scaled_mm` per group, on CPU bitwise the dequantized fp32 matmul. The scales
    are multipliers (torchao's: bits = t * scale); the kernels take their inverses."""
    (qa, sa), (qb, sb) = a_fp8, b_fp8
    sb = sb.expand(qb.shape[0], 1, qb.shape[2])
    if qa.is_cuda and qa.dtype == qb.dtype == E4M3 and out_dtype == torch.bfloat16:
        return grouped_launch(qa, sa, qb, sb, counts_L, out_dtype, torch._scaled_grouped_mm)
    ys = [torch._scaled_mm(a, b.t().contiguous().t(), scale_a=s.reciprocal(), scale_b=t.reciprocal().contiguous(),
                           out_dtype=out_dtype)
          for a, s, b, t, n in zip(qa.split(counts_L), sa.split(counts_L), qb.unbind(0), sb.unbind(0), counts_L) if n]
    return torch.cat(ys) if ys else qa.new_zeros(0, qb.shape[2], dtype=out_dtype)


def grouped_launch(qa, sa, qb, sb, counts_L: list[int], out_dtype: torch.dtype, kernel) -> torch.Tensor:
    """One grouped launch of `kernel` (torch._scaled_grouped_mm's signature): each group's rows placed at a start
    that is a multiple of ALIGN_M (padding rows zero, with scale 1), b column-major per group, 1-D row scales,
    [L, N] column scales and int32 end offsets, as the kernel takes them; the padding rows dropped again."""
    dev, n = qa.device, qa.shape[0]
    counts = torch.tensor(counts_L)
    padded = (counts + ALIGN_M - 1) // ALIGN_M * ALIGN_M
    # each row's place in the padded buffer: its own index plus its group's shift (padded start - start), made
    # on the device from L numbers (sizes known here: no host read)
    shift = (padded.cumsum(0) - padded - counts.cumsum(0) + counts).to(dev, non_blocking=True)
    rows = torch.arange(n, device=dev) + shift.repeat_interleave(counts.to(dev, non_blocking=True), output_size=n)
    total = int(padded.sum())
    # (as bytes: index_copy_ takes no FP8 dtype; zero bytes are e4m3's 0.0)
    a = qa.new_zeros(total, qa.shape[1]).view(torch.uint8).index_copy_(0, rows, qa.view(torch.uint8)).view(qa.dtype)
    s = sa.new_ones(total).index_copy_(0, rows, sa.reshape(-1).reciprocal())
    offs = padded.cumsum(0).to(torch.int32).to(dev, non_blocking=True)
    y = kernel(a, qb.transpose(1, 2).contiguous().transpose(1, 2), s, sb.reshape(sb.shape[0], -1).reciprocal(),
               offs=offs, out_dtype=out_dtype)
    return y.index_select(0, rows)


class ExpertsMM(torch.autograd.Function):
    """y = x @ w[g] for L experts' contiguous row groups of x [n, K] (`counts_L` rows each) and their weights
    w [L, K, N] in FP8 (the module docstring says why these scales): forward e4m3 x per row, each w per column (or
    whole); grad_x = dy @ w[g]^T with dy per row in the recipe's gradient dtype, w^T per column; grad_w = x^T @ dy
    per group in high precision. The FP8 GEMMs are `grouped_mm`'s. With x's FP8 operand handed in (bits, scales:
    parallel.fp8_comm, `experts`) the forward reads those bits and grad_w their dequantized values, so it is the
    same wherever the operand was made: on this rank, or on the rank that sent it. With fp8.wire w's operand too
    is the same wherever it was made (here, or cast on the shards and all-gathered in FP8 under ZeRO-3:
    `_expert_weight`), and grad_x's w^T is made from it (`_expert_weight_t`)."""

    @staticmethod
    def forward(ctx, x, w, counts_L: list[int], fp8: Fp8, bits=None, scale=None):
        ctx.save_for_backward(x if bits is None else dequantize(bits, scale, x.dtype), w)
        ctx.fp8, ctx.counts = fp8, counts_L
        a = (bits, scale) if bits is not None else quantize(x, fp8.forward_dtype, -1, fp8.pow2)
        b = _expert_weight(w, fp8) if fp8.wire else quantize(w, fp8.forward_dtype, _w_dims(fp8), fp8.pow2)
        return grouped_mm(a, b, counts_L, x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        f, counts = ctx.fp8, ctx.counts
        dx = dw = None
        if ctx.needs_input_grad[0]:
            w_t, w_t_fp8 = _expert_weight_t(w, f) if f.wire else (w.transpose(1, 2), None)
            b = w_t_fp8 if w_t_fp8 is not None else quantize(w_t, f.forward_dtype, _w_dims(f), f.pow2)
            dx = grouped_mm(quantize(dy, f.grad_dtype, -1, f.pow2), b, counts, dy.dtype)
        if ctx.needs_input_grad[1]:
            dy = dy.to(x.dtype)
            dw = torch.stack([a.t().mm(g) for a, g in zip(x.split(counts), dy.split(counts))])
        return dx, dw, None, None, None, None


def _w_dims(fp8: Fp8) -> int | tuple[int, int]:
    """The dims of a stack of expert weights [L, K, N] each scale spans: per column (rowwise) or each whole."""
    return 1 if fp8.rowwise else (1, 2)


def _expert_weight(w: torch.Tensor, fp8: Fp8) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' weights [L, K, N] as their forward operand (bits, scale per column or each whole): as an FP8
    all-gather delivered them (`Fp8Weight`), else cast here."""
    got = operand(w)
    return got if got is not None else quantize(w, fp8.forward_dtype, _w_dims(fp8), fp8.pow2)


def _expert_weight_t(w: torch.Tensor, fp8: Fp8) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """(w^T per expert, its operand or None) for grad_x, made from the forward's operand: tensorwise, the same bits
    transposed under the same scale; rowwise (per column of w^T, not of w), the forward operand's values, which
    grad_x casts again: a second rounding, exact but for elements subnormal under one of the two power-of-2
    scales (docs/fp8.md "FP8 weights on the wire")."""
    bits, scale = _expert_weight(w, fp8)
    if fp8.rowwise:
        return dequantize(bits, scale, w.dtype).transpose(1, 2), None
    return w.transpose(1, 2), (bits.transpose(1, 2), scale)


def experts(x_ND: torch.Tensor, W_gate: torch.Tensor, W_val: torch.Tensor, W_out: torch.Tensor,
            counts_L: list[int], fp8: Fp8, x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """L SwiGLU experts on contiguous row groups, each GEMM one `ExpertsMM` over all L, under plain autograd. With
    fp8.wire (parallel.fp8_comm) the gate and value GEMMs take x's FP8 operand: `x_fp8` (bits, per-row scales)
    as the EP dispatch delivered it, else made here, the same bits (per row: a row's scale is the same in any
    group of rows); and the output's gradient reaches the experts rounded per row to the recipe's gradient dtype,
    by the EP combine trip that carries it in FP8 or else here (`_GradAsOnTheWire`). mxfp8: torchao's MXFP8
    grouped GEMMs (model/mxfp8.py)."""
    if isinstance(fp8, mxfp8.Mxfp8):
        return mxfp8.experts(x_ND, W_gate, W_val, W_out, counts_L, fp8)
    dev = x_ND.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        x_ND, W_gate, W_val, W_out = (t.to(dt) for t in (x_ND, W_gate, W_val, W_out))
    sent = x_fp8 is not None  # by the EP dispatch, whose combine trip carries the output's gradient in FP8
    if fp8.wire and x_fp8 is None:
        x_fp8 = quantize(x_ND, fp8.forward_dtype, -1, fp8.pow2)
    bits, scale = x_fp8 if fp8.wire else (None, None)
    h = (torch.nn.functional.silu(ExpertsMM.apply(x_ND, W_gate, counts_L, fp8, bits, scale))
         * ExpertsMM.apply(x_ND, W_val, counts_L, fp8, bits, scale))
    y = ExpertsMM.apply(h, W_out, counts_L, fp8)
    return _GradAsOnTheWire.apply(y, fp8) if fp8.wire and not sent else y


class _GradAsOnTheWire(torch.autograd.Function):
    """parallel.fp8_comm where no EP trip carries the experts' output: its gradient rounded as the FP8 combine trip
    (parallel/ep.py `_Fp8Combine`) carries it, each row to the recipe's gradient dtype with its own scale, so every
    layout's experts read the same gradient values."""

    @staticmethod
    def forward(ctx, y, fp8: Fp8):
        ctx.fp8 = fp8
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        bits, scale = quantize(dy, ctx.fp8.grad_dtype, -1, ctx.fp8.pow2)
        return dequantize(bits, scale, dy.dtype), None
