"""The planner's FP8 (plan/fp8.py): GEMMs at the profile's FP8 rate with their casts, the rest in bf16; the
what-if prices the recipe against fp8 off on its best layout; a GPU without FP8 units is refused in one line."""

import dataclasses
import json

import pytest

from nanotitan.config.config import ConfigError, load_config
from nanotitan.config.hardware import BUILTIN, get_hardware
from nanotitan.plan import Layout, PlanOptions, layout_config, predict
from nanotitan.plan.fp8 import (cast_s_per_flop, dense_fp8_share, ep_wire_ratio, fp8_param_share, gather_ratios,
                                gemm_rates)
from nanotitan.plan.shape import ModelShape

# Mixtral-8x7B's shape cut to 4 layers (dimensions multiples of 16, as the FP8 GEMM needs)
MIXTRAL = ("--model.vocab_size 32000 --data.vocab_size 32000 --model.d_model 4096 --model.n_layers 4 "
           "--model.n_heads 32 --model.ffn_dim 14336 --model.num_experts 8 --model.top_k 2 --train.seq_len 4096 "
           "--model.max_seq_len 4096 --train.dtype bf16 --train.micro_batch 1").split()
LAY = Layout(1, 2, 4, "1f1b", 8, 1)


def _step(recipe: str, hw: str = "h100-sxm") -> float:
    cfg = layout_config(load_config(None, MIXTRAL + ["--train.fp8", recipe]), LAY)
    return predict(cfg, LAY, get_hardware(hw), PlanOptions(nodes=1)).step_time_s


def test_fp8_prices_its_gemms_at_the_fp8_rate_with_their_casts_and_the_rest_in_bf16():
    off, rowwise, tensorwise = _step("off"), _step("rowwise"), _step("tensorwise")
    assert off / 2 < tensorwise < rowwise < off  # the GEMMs at most 2x faster; rowwise casts twice as much
    assert _step("rowwise", "b200") < _step("off", "b200")
    cfg = load_config(None, MIXTRAL + ["--train.fp8", "rowwise"])
    shape, hw = ModelShape.from_config(cfg), get_hardware("h100-sxm")
    a = dense_fp8_share(shape)  # projections and the dense/shared FFNs; not the scores or the router
    assert 0.3 < a < 1.0
    dense, expert = gemm_rates(cfg, shape, hw, hw.peak_flops_bf16, 4096, 2048, 1, 0.45, 0.45)
    assert hw.peak_flops_bf16 < dense < hw.peak_flops_fp8 and hw.peak_flops_bf16 < expert < hw.peak_flops_fp8
    # the casts' bytes per FLOP: 2 casts of each operand rowwise, 1 tensorwise; fewer rows, more per FLOP
    assert cast_s_per_flop(hw, "rowwise", 4096, 4096, 4096) == pytest.approx(
        2 * cast_s_per_flop(hw, "tensorwise", 4096, 4096, 4096))
    assert cast_s_per_flop(hw, "rowwise", 64, 4096, 4096) > 10 * cast_s_per_flop(hw, "rowwise", 4096, 4096, 4096)
    # fp8 off prices exactly as before: both rates are the precision's peak
    plain = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, fp8="off"))
    assert gemm_rates(plain, shape, hw, 7.0, 4096, 2048, 1, 0.45, 0.45) == (7.0, 7.0)


def test_fp8_comm_prices_the_fp8_trips_and_gathers_at_their_bytes():
    """parallel.fp8_comm: the dispatch's forward trip and the combine's gradient trip carry a byte an element and the
    row's scale (exponent byte rowwise, fp32 tensorwise), the other two trips bf16; at zero 3 the FP8 GEMMs' weights
    are gathered as their FP8 operand. The EP and DP terms shrink by those ratios, nothing else moves."""
    def cfg_of(*extra):
        return layout_config(load_config(None, MIXTRAL + ["--train.fp8", "rowwise", *extra]), LAY)

    wire = cfg_of("--parallel.fp8_comm", "true")
    assert ep_wire_ratio(wire, 4096, 2) == pytest.approx((2 + 2 * 4097 / 8192) / 4)
    assert ep_wire_ratio(cfg_of(), 4096, 2) == 1.0
    tensorwise = layout_config(load_config(None, MIXTRAL + ["--train.fp8", "tensorwise", "--parallel.fp8_comm",
                                                            "true"]), LAY)
    assert ep_wire_ratio(tensorwise, 4096, 2) == pytest.approx((2 + 2 * 4100 / 8192) / 4)
    hw, opts = get_hardware("h100-sxm"), PlanOptions(nodes=1)
    plain, fast = predict(cfg_of(), LAY, hw, opts), predict(wire, LAY, hw, opts)
    assert fast.costs["ep_a2a"] < plain.costs["ep_a2a"] and fast.costs["compute"] == plain.costs["compute"]

    z3 = Layout(2, 1, 4, "1f1b", 4, 1, zero=3)
    lay3 = ("--parallel.dp", "2", "--parallel.ep", "4", "--parallel.microbatches", "4", "--parallel.zero", "3")
    share = fp8_param_share(ModelShape.from_config(cfg_of()))
    assert 0.5 < share < 1.0  # the projections; not the norms, the router, the embedding, the head
    z3_wire = layout_config(load_config(None, MIXTRAL + ["--train.fp8", "rowwise", "--parallel.fp8_comm", "true",
                                                         *lay3]), z3)
    assert gather_ratios(z3_wire, ModelShape.from_config(z3_wire), 2, 3) == pytest.approx((share / 2 + 1 - share, 0.5))
    assert gather_ratios(wire, ModelShape.from_config(wire), 2, 1) == (1.0, 1.0)  # zero < 3: no all-gather of weights
    z3_plain = layout_config(load_config(None, MIXTRAL + ["--train.fp8", "rowwise", *lay3]), z3)
    exposed = dataclasses.replace(hw, dp_overlap=0.0)  # nothing hides the gathers: their seconds show
    a, b = predict(z3_plain, z3, exposed, opts), predict(z3_wire, z3, exposed, opts)
    assert b.costs["dp_allreduce"] < a.costs["dp_allreduce"] and b.costs["compute"] == a.costs["compute"]


def test_a_cpu_emulates_fp8_slower_than_its_fp32_and_a_gpu_without_fp8_units_is_refused_in_one_line():
    assert _step("rowwise", "cpu-gloo") > _step("off", "cpu-gloo")
    assert not BUILTIN["a100-80gb"].peak_flops_fp8
    assert BUILTIN["h800"].peak_flops_fp8 == BUILTIN["h100-sxm"].peak_flops_fp8
    assert BUILTIN["h100-sxm"].peak_flops_fp8 == pytest.approx(2 * BUILTIN["h100-sxm"].peak_flops_bf16, rel=1e-4)
    with pytest.raises(ConfigError, match=r"train.fp8: a100-80gb has no FP8 tensor cores .*fp8 off.*h100-sxm") as e:
        _step("rowwise", "a100-80gb")
    assert "\n" not in str(e.value)


def test_what_if_prices_fp8_against_fp8_off_on_its_best_layout(capsys):
    from nanotitan.plan.cli import main

    args = ["--what-if", "--hardware", "h100", "--nodes", "1", "--ranks", "8", "--no-dry-run", "--top", "2",
            "--global-batch", "16", "--micro-batch", "any", *MIXTRAL]
    assert main([*args, "--train.fp8", "rowwise", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    k = r["fp8"]
    assert k["recipe"] == "rowwise" and k["step_time_s"] == r["best"]["step_time_s"]
    assert 1.0 < k["speedup"] < 2.0 and k["step_time_off_s"] == pytest.approx(k["step_time_s"] * k["speedup"])
    assert main(args) == 0
    assert "FP8" not in capsys.readouterr().out  # no recipe, no line
    assert main([*args, "--train.fp8", "tensorwise"]) == 0
    assert "FP8 (tensorwise): the step takes" in capsys.readouterr().out


def test_mxfp8_is_priced_at_the_mxfp8_rate_where_a_profile_has_one_and_refused_in_one_line_where_not():
    """B200 and GB300 run MXFP8 at their FP8 rate; Hopper has no MXFP8 units (its FP8 is per-tensor/row scaled); a
    CPU emulates it as torchao's EMULATED mode does (dequantize, then the fp32 GEMM)."""
    assert BUILTIN["b200"].peak_flops_mxfp8 == BUILTIN["b200"].peak_flops_fp8
    assert BUILTIN["gb300"].peak_flops_mxfp8 == BUILTIN["gb300"].peak_flops_fp8
    assert _step("mxfp8", "b200") == pytest.approx(_step("rowwise", "b200"))  # same rate, casts along both axes
    assert _step("mxfp8", "b200") < _step("off", "b200")
    assert _step("mxfp8", "cpu-gloo") > _step("off", "cpu-gloo")
    with pytest.raises(ConfigError, match=r"train.fp8: h100-sxm has no MXFP8 tensor cores .*--train.fp8 rowwise "
                                          r"\(Hopper's FP8\) or off.*b200") as e:
        _step("mxfp8", "h100-sxm")
    assert "\n" not in str(e.value)
