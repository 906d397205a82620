"""verify's judge, flags and draws, without a rank: the relative error and coverage of a tensor's boxes, the order
and verdict of a report, the layout's axes of a row, --layout and the command's flags, the fuzzer's same-seed draws
and its refusal table, a planted fault's spec."""

import math

import pytest
import torch

from nanotitan.config.config import ConfigError, load_config
from nanotitan.parallel.comm.fault import Fault, bump
from nanotitan.verify import fuzz
from nanotitan.verify.check import parse_layout
from nanotitan.verify.command import split_flags
from nanotitan.verify.compare import FP32, Layout, Row, compare, first_loss_step, fp8, rel_error, verdict


def test_rel_error_over_boxes_and_their_coverage():
    ref = torch.arange(1.0, 13.0).view(3, 4)
    halves = [((0, 0), ref[:, :2].clone()), ((0, 2), ref[:, 2:].clone())]
    assert rel_error(ref, halves) == (0.0, "")
    wrong = [((0, 0), ref[:, :2] + 1e-3), ((0, 2), ref[:, 2:].clone())]
    rel, note = rel_error(ref, wrong)
    # (fp32 rounds the +1e-3)
    assert not note and rel == pytest.approx(1e-3 * math.sqrt(6) / ref.norm().item(), rel=1e-3)
    rel, note = rel_error(ref, halves[:1])  # an expert, a slice no rank holds
    assert rel == math.inf and "6 of its 12 elements" in note
    # a replica that drifted counts as a wrong slice does
    rel, _ = rel_error(ref, halves + [((0, 0), ref[:, :2] * 2)])
    assert rel > 0.1


def _result(tensors: dict, order: list[str], steps: list[dict]) -> dict:
    return {"tensors": tensors, "order": order, "steps": steps, "sliced": [], "fault": ""}


def _steps(n: int, loss: float = 2.0) -> list[dict]:
    return [{"lr": 1e-3, "ce": loss, "aux": 0.1, "mtp": None, "loss": loss + 0.1, "grad_norm": 1.0, "skipped": False,
             "qk_max": None}] * n


def test_rows_come_in_execution_order_and_name_the_first_divergence():
    x = torch.ones(1, 4, 2, 3)
    ref = _result({"act.layers.0.attn": ((1, 4, 2, 3), [((0, 0, 0, 0), x)]),
                   "act.layers.0": ((1, 4, 2, 3), [((0, 0, 0, 0), x)]),
                   "grad.w": ((2,), [((0,), torch.ones(2))]), "grad.v": ((2,), [((0,), torch.ones(2))]),
                   "model.w": ((2,), [((0,), torch.ones(2))])},
                  ["layers.0.attn", "layers.0"], _steps(2))
    bad = dict(ref["tensors"], **{"act.layers.0": ((1, 4, 2, 3), [((0, 0, 0, 0), x * 1.01)]),
                                  "grad.v": ((2,), [((0,), torch.ones(2) * 3)])})
    layout = Layout({"dp": 2, "pp": 1, "ep": 1, "tp": 1, "cp": 1}, set())
    rows = compare(ref, [_result(bad, [], _steps(2, loss=2.5))], FP32, layout)
    names = [r.name for r in rows]
    # step 1: lr, the forward in the reference's call order, the losses, the gradients in backward order, ...
    assert names[:3] == ["step 1 lr", "layers.0.attn", "layers.0"]
    assert names.index("grad v") < names.index("grad w") < names.index("model w") < names.index("step 2 lr")
    assert verdict(rows).startswith("verify: first divergence: layers.0 (rel 0.01 > tol 1e-05")
    assert first_loss_step(rows) == 1
    assert rows[names.index("layers.0")].axes == ["dp"]
    same = compare(ref, [ref], FP32, layout)
    assert all(r.ok for r in same) and verdict(same) == f"verify: equal ({len(same)} tensors, worst 0)"


def test_fp8_holds_step_one_to_fp32_and_later_figures_to_bf16():
    """Under FP8 a grad norm 5e-5 off at step 2 (a cast's rounding flip once the weights differ in their last bits)
    is within its bar; the same at step 1, where every cast reads the same bits, is a divergence."""
    ref = _result({"grad.w": ((2,), [((0,), torch.ones(2))])}, [], _steps(2))
    layout = Layout({"dp": 2, "pp": 1, "ep": 1, "tp": 1, "cp": 1}, set())
    later = [dict(s) for s in _steps(2)]
    later[1]["grad_norm"] = 1.0 + 5e-5
    assert verdict(compare(ref, [_result(ref["tensors"], [], later)], fp8(256), layout)).startswith("verify: equal")
    assert not all(r.ok for r in compare(ref, [_result(ref["tensors"], [], later)], FP32, layout))
    first = [dict(s) for s in _steps(2)]
    first[0]["grad_norm"] = 1.0 + 5e-5
    assert verdict(compare(ref, [_result(ref["tensors"], [], first)], fp8(256), layout)).startswith(
        "verify: first divergence: step 1 grad_norm")


def test_a_tensor_no_rank_holds_or_the_reference_lacks_is_a_divergence():
    ref = _result({"grad.w": ((2,), [((0,), torch.ones(2))])}, [], _steps(1))
    layout = Layout({"ep": 2}, set())
    missing = compare(ref, [_result({}, [], _steps(1))], FP32, layout)
    assert next(r for r in missing if not r.ok).note == "no rank holds it"
    extra = compare(ref, [_result({**ref["tensors"], "model.x": ((1,), [((0,), torch.ones(1))])}, [], _steps(1))],
                    FP32, layout)
    assert [r.name for r in extra if not r.ok] == ["model.x"]


def test_axes_of_a_row_follow_how_the_layout_lays_it():
    lay = Layout({"dp": 2, "pp": 2, "ep": 2, "tp": 2, "cp": 1}, {"layers.0.attn.q_proj.weight"})
    assert lay.axes("act.layers.0.moe") == ["dp", "ep", "tp", "pp"]
    assert lay.axes("grad.layers.0.moe.experts.W_gate.3") == ["dp", "ep", "tp", "pp"]
    assert lay.axes("grad.layers.0.attn.q_proj.weight") == ["dp", "ep", "tp", "pp"]
    assert lay.axes("optim.layers.0.attn_norm.weight.exp_avg") == ["dp", "ep", "pp"]


def test_layout_and_flags_parse_or_fail_in_one_line():
    assert parse_layout("dp=2,pp=2,ep=2") == {"dp": 2, "pp": 2, "ep": 2, "tp": 1, "cp": 1}
    for bad in ("dp=2,dp=2", "xp=2", "dp=0", "dp"):
        with pytest.raises(ConfigError, match="--layout"):
            parse_layout(bad)
    own, rest = split_flags(["--layout", "tp=2", "--steps=2", "--model.d_model", "32", "--hf-export"])
    assert own == {"--layout": "tp=2", "--steps": 2, "--hf-export": True} and rest == ["--model.d_model", "32"]
    with pytest.raises(ConfigError, match="--steps='x' must be int"):
        split_flags(["--steps", "x"])


def test_the_fuzzer_draws_the_same_cases_for_a_seed():
    a, b = fuzz.draw(12, seed=3), fuzz.draw(5, seed=3)
    assert [c.flags for c in a[:5]] == [c.flags for c in b]
    assert [c.flags for c in fuzz.draw(12, seed=4)] != [c.flags for c in a]
    worlds = {math.prod(int(f) for k, f in zip(c.flags[::2], c.flags[1::2]) if k in (
        "--parallel.dp", "--parallel.pp", "--parallel.ep", "--parallel.tp", "--parallel.cp")) for c in a}
    assert worlds <= set(range(1, 9))


# One combination per row of the refusal table (docs/verify.md "Refusals"), on the fuzzer's tiny model
REFUSED = {
    "ddp-not-pure-dp": ["--parallel.dp_impl", "torch_ddp", "--parallel.ep", "2"],
    "zero-with-ddp": ["--parallel.dp_impl", "torch_ddp", "--parallel.dp", "2", "--parallel.zero", "1"],
    "zero-nothing-to-shard": ["--parallel.zero", "1"],
    "zero3-schedule": ["--parallel.zero", "3", "--parallel.dp", "2", "--parallel.pp", "2", "--parallel.schedule", "zb1"],
    "interleaved-microbatches": ["--parallel.pp", "2", "--parallel.schedule", "interleaved",
                                 "--parallel.virtual_stages", "2", "--parallel.microbatches", "3"],
    "interleaved-chunks": ["--parallel.pp", "4", "--parallel.schedule", "interleaved", "--parallel.virtual_stages", "2",
                           "--parallel.microbatches", "4"],
    "lanes-need-ep": ["--parallel.ep_overlap_microbatches", "true", "--parallel.microbatches", "2"],
    "lanes-need-microbatches": ["--parallel.ep_overlap_microbatches", "true", "--parallel.ep", "2"],
    "lanes-zero3": ["--parallel.ep_overlap_microbatches", "true", "--parallel.ep", "2", "--parallel.microbatches", "2",
                    "--parallel.zero", "3"],
    "lanes-tp-cp": ["--parallel.ep_overlap_microbatches", "true", "--parallel.ep", "2", "--parallel.microbatches", "2",
                    "--parallel.tp", "2"],
    "ep-overlap-one-expert": ["--parallel.ep_overlap", "true", "--parallel.ep", "8"],
    "qk-clip-qk-norm": ["--train.qk_clip", "1", "--model.qk_norm", "head"],
    "qk-clip-cp": ["--train.qk_clip", "1", "--parallel.cp", "2"],
    "placement-one-rank": ["--parallel.expert_placement", "balanced", "--parallel.dp", "2"],
    "replicas-over-ranks": ["--parallel.expert_placement", "balanced", "--parallel.ep", "2",
                            "--parallel.expert_replicas", "3"],
    "a2a-heads": ["--parallel.cp", "4", "--parallel.cp_impl", "a2a", "--parallel.tp", "2"],
    "cp-split-docs": ["--parallel.cp", "2", "--parallel.cp_split", "docs"],
    "fp8-width": ["--train.fp8", "rowwise", "--model.ffn_dim", "40"],
    "fp8-replicated-kv": ["--train.fp8", "rowwise", "--parallel.tp", "2", "--model.n_kv_heads", "1",
                          "--model.head_dim", "16"],
    "fp8-mla-ring": ["--train.fp8", "rowwise", "--parallel.cp", "2", "--model.kv_lora_rank", "16",
                     "--model.qk_nope_head_dim", "8", "--model.qk_rope_head_dim", "8", "--model.v_head_dim", "8"],
    "fp8-comm-off": ["--parallel.fp8_comm", "true"],
    "mxfp8-token-blocks": ["--train.fp8", "mxfp8", "--model.ffn_dim", "64", "--train.micro_batch", "1"],
    "mxfp8-comm": ["--train.fp8", "mxfp8", "--model.ffn_dim", "64", "--parallel.ep", "2", "--parallel.fp8_comm",
                   "true"],
    "fp8-static-dispatch": ["--train.fp8", "rowwise", "--parallel.ep", "2", "--parallel.ep_dispatch", "static",
                            "--model.experts_impl", "grouped"],
    "fp8-comm-zero3-compile": ["--train.fp8", "rowwise", "--parallel.fp8_comm", "true", "--parallel.dp", "2",
                               "--parallel.zero", "3", "--train.compile", "true"],
    "fp8-ep-overlap": ["--train.fp8", "rowwise", "--parallel.ep", "2", "--parallel.ep_overlap", "true"],
    "kv-heads-tp": ["--model.n_heads", "6", "--model.n_kv_heads", "3", "--model.d_model", "48", "--parallel.tp", "2"],
    "tp-divides": ["--parallel.tp", "8"],
    "experts-fold": ["--parallel.ep", "4", "--parallel.tp", "4"],
    "static-nothing": ["--parallel.ep_dispatch", "static"],
    "static-host-sizes": ["--parallel.ep_dispatch", "static", "--parallel.ep", "2", "--model.experts_impl", "loop"],
    "bf16-reduce": ["--parallel.reduce_dtype", "bf16", "--parallel.zero", "3", "--parallel.dp", "2"],
    "cuda-graphs-cpu": ["--train.cuda_graphs", "true", "--train.compile", "true", "--train.device", "cpu"],
}


def test_every_refusal_row_names_the_line_the_config_gives():
    assert sorted(REFUSED) == sorted(key for key, *_ in fuzz.REFUSALS)
    for key, flags in REFUSED.items():
        with pytest.raises(ConfigError) as e:
            load_config(None, [*fuzz.BASE, *flags])
        assert fuzz.refusal(str(e.value)) == key, (key, str(e.value))
    assert fuzz.refusal("something new") == "other"


def test_a_fault_spec_names_an_axis_call_and_rank():
    assert Fault.parse("ep:2:1") == Fault("ep", 2, 1)
    for bad in ("xx", "ep:a", "ep:1:2:3"):
        with pytest.raises(ValueError, match="AXIS"):
            Fault.parse(bad)
    t = torch.tensor([1.0, -4.0])
    bump(t)
    assert t.tolist() == [5.0, -4.0]
    z = torch.zeros(3)
    bump(z)
    assert z.tolist() == [1.0, 0.0, 0.0]
