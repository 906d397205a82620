"""Mixed precision as GPU users run it, exercised on CPU (docs/precision.md).

Contracts: with train.dtype=bf16 the forward (and only the forward) runs under bf16 autocast while
parameters, gradients and optimizer state stay fp32; EP payloads travel in bf16 (half the bytes, and the
same forward values as one process); parallel.reduce_dtype=bf16 reduces a bf16 copy of each bucket (half
the bytes, the sum rounded once); a CPU tensor never reaches a collective of a backend that cannot take
it; the MFU and planner peaks are those of the dtype in use; bad precision options fail in one line.
Cost: one 2-rank launch (~8 s), the rest in-process (~2 s).
"""

import dataclasses
import types

import pytest
import torch
import torch.distributed as dist

from nanotitan.observe import metrics
from nanotitan.config.config import ConfigError, load_config
from nanotitan.config.hardware import BUILTIN, load_hardware, save_hardware
from nanotitan.model.moe import ExpertFFN, LocalDispatcher
from nanotitan.parallel.comm import collectives as comm
from nanotitan.parallel.dp import reducer as dp, zero
from nanotitan.parallel import step as S
from nanotitan.parallel.dims import ParallelDims
from nanotitan.parallel.ep import EPDispatcher
from nanotitan.parallel.placement import EPShard, identity
from nanotitan.parallel.parallelize import parallelize
from nanotitan.resolve import resolve
from tests.helpers.mp import run_ranks
from tests.helpers.tiny import tiny_args

TINY = tiny_args("seq_len", "micro_batch", n_layers=2)


def test_bf16_forward_only_autocast_fp32_state():
    """bf16: GEMMs of the forward in bf16, every backward op outside autocast, params/grads/AdamW state fp32,
    and the loss (CE and balance loss) in fp32."""
    torch.manual_seed(0)
    cfg = resolve(load_config(None, TINY + ["--train.dtype", "bf16"]))
    shard = parallelize(cfg, ParallelDims(1, 1, 1, rank=0), torch.device("cpu"))
    model = shard.model
    seen = {"fwd": [], "bwd": []}
    model.layers["0"].attn.q_proj.register_forward_hook(
        lambda mod, inp, out: seen["fwd"].append((out.dtype, torch.is_autocast_enabled("cpu"))))
    for p in model.parameters():  # fires inside backward, on this thread (CPU autograd runs on the caller's)
        p.register_post_accumulate_grad_hook(lambda p: seen["bwd"].append(torch.is_autocast_enabled("cpu")))
    xs = list(torch.randint(0, 300, (2, 2, 16)))
    stats = S.forward_backward(shard, xs, list(torch.randint(0, 300, (2, 2, 16))), schedule="1f1b",
                               aux_weight=0.01, device=torch.device("cpu"), dtype="bf16")
    S.finish_grads(shard)
    assert seen["fwd"] == [(torch.bfloat16, True)] * 2
    assert seen["bwd"] and not any(seen["bwd"]), "a backward ran under autocast"
    assert stats.ce_sum.dtype == torch.float32 and stats.aux_sum.dtype == torch.float32
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    opt.step()
    for name, p in model.named_parameters():
        assert p.dtype == p.grad.dtype == torch.float32, name
        assert all(v.dtype == torch.float32 for v in opt.state[p].values()), name


def test_comm_refuses_cpu_tensor_on_nccl(monkeypatch):
    """Every collective of the communication layer checks its tensors before calling torch.distributed: with
    the backend reported as NCCL, a CPU tensor fails naming the backend (no process group needed: the check
    comes first); gloo and a mixed cpu:gloo,cuda:nccl group take it."""
    t = torch.zeros(4)
    calls = {
        "all_reduce": lambda: comm.all_reduce(t),
        "broadcast": lambda: comm.broadcast(t, src=0),
        "all_to_all_single": lambda: comm.all_to_all_single(torch.zeros(4), t),
        "send": lambda: comm.send(t, 1),
        "recv": lambda: comm.recv(t, 1),
        # P2POp needs a process group to be built; the check reads only .tensor and .group
        "batch_isend_irecv": lambda: comm.batch_isend_irecv([types.SimpleNamespace(tensor=t, group=None)]),
        "reduce_scatter": lambda: comm.reduce_scatter(torch.zeros(2), t, None),
        "all_gather": lambda: comm.all_gather(torch.zeros(8), t, None),
    }
    monkeypatch.setattr(comm.dist, "get_backend", lambda group=None: "nccl")
    for call in calls.values():
        with pytest.raises(RuntimeError, match="reached a nccl collective"):
            call()
    for backend in ("gloo", "cpu:gloo,cuda:nccl"):
        monkeypatch.setattr(comm.dist, "get_backend", lambda group=None, b=backend: b)
        assert comm.check_device(t) is t
    monkeypatch.setattr(comm.dist, "get_backend", lambda group=None: "nccl")
    assert comm.check_device(torch.zeros(4, device="meta")) is not None  # a device tensor is never refused


def _experts(E: int, D: int, F: int, start: int, L: int) -> ExpertFFN:
    full = ExpertFFN(E, D, F)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for w in (full.W_gate, full.W_val, full.W_out):
            w.copy_(torch.randn(w.shape, generator=g) * 0.2)
    part = ExpertFFN(L, D, F)
    with torch.no_grad():
        for w, v in zip((part.W_gate, part.W_val, part.W_out), (full.W_gate, full.W_val, full.W_out)):
            w.copy_(v[start:start + L])
    return part


def _wire_and_reduce(rank, world):
    out = {}
    # --- EP: the same routed tokens in fp32 and under bf16 autocast ---------------------------------------
    E, D, F, T, K = 4, 32, 48, 40, 2
    g = torch.Generator().manual_seed(100 + rank)
    x_TD = torch.randn(T, D, generator=g)
    ids_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w_TK = torch.rand(T, K, generator=g)
    L = E // world
    disp = EPDispatcher(EPShard(identity(E, world), rank), dist.group.WORLD)
    for dtype in ("fp32", "bf16"):
        experts = _experts(E, D, F, rank * L, L)
        x = x_TD.clone().requires_grad_()
        comm.COMM.reset()
        with S.autocast(torch.device("cpu"), dtype):
            y = disp(x, ids_TK, w_TK, experts, E)
        y.float().square().sum().backward()  # outside autocast, as the trainer runs it
        out[f"ep_bytes_{dtype}"] = comm.COMM.bytes["ep"]
        out[f"ep_y_{dtype}"] = y.detach()
        out[f"ep_xgrad_{dtype}"] = x.grad
        if dtype == "bf16":  # one process holding all experts, on this rank's tokens
            x = x_TD.clone().requires_grad_()
            with S.autocast(torch.device("cpu"), dtype):
                y = LocalDispatcher()(x, ids_TK, w_TK, _experts(E, D, F, 0, E), E)
            y.float().square().sum().backward()
            out["local_y_bf16"], out["local_xgrad_bf16"] = y.detach(), x.grad
    out["count_bytes"] = world * E * 8  # the one int64 count exchange per forward: every expert's count to each rank
    # --- DP: replicated and sharded reducers, fp32 and bf16 reduction ---------------------------------------
    n, scale = 1000, 0.5
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    for kind in ("reducer", "zero1", "zero2"):
        for rdt in (None, torch.bfloat16):
            p = torch.nn.Parameter(torch.zeros(n))
            red = (dp.Reducer([("w", p)], dist.group.WORLD, 25, scale, reduce_dtype=rdt) if kind == "reducer" else
                   zero.ShardedReducer([("w", p)], dist.group.WORLD, 25, scale, zero=int(kind[-1]), reduce_dtype=rdt))
            comm.COMM.reset()
            red.prepare(sync=True)
            (p * grads[rank]).sum().backward()
            red.finish()
            got = p.grad if kind == "reducer" else red.buckets[0].shard_grad
            out[f"{kind}_{rdt}"] = (got.clone(), comm.COMM.bytes["dp"], red.buckets[0].padded
                                    if kind != "reducer" else n)
    out["grads"] = grads
    return out


def test_bf16_wire_bytes_and_reduce_dtype():
    """EP: bf16 payloads are exactly half the fp32 bytes (the int64 count exchange aside) and the forward equals
    one process's bf16 forward bitwise (the experts' GEMMs would have cast x anyway); the input gradient
    is one process's to one bf16 rounding. DP: reduce_dtype=bf16 halves the bytes and gives bf16(sum of bf16 scaled
    grads), for the Reducer and ZeRO-1/2's shard of it; fp32 reduction is unchanged."""
    world = 2
    res = run_ranks(_wire_and_reduce, world, timeout=120)
    for r, o in enumerate(res):
        c = o["count_bytes"]
        assert o["ep_bytes_fp32"] > 10 * c
        assert o["ep_bytes_bf16"] - c == (o["ep_bytes_fp32"] - c) // 2, f"rank {r}: EP bytes not halved"
        assert o["ep_y_bf16"].dtype == torch.bfloat16
        assert torch.equal(o["ep_y_bf16"], o["local_y_bf16"]), f"rank {r}: EP bf16 forward != one process"
        # The input gradient crosses the wire in bf16 (its two GEMM contributions summed there): one bf16 rounding
        # from one process's, in norm, which is 2^-8 relative at most.
        g, want = o["ep_xgrad_bf16"], o["local_xgrad_bf16"]
        assert g.dtype == torch.float32 and 0 < (g - want).norm() <= 2**-8 * want.norm(), f"rank {r}: EP x grad"
        g0, g1 = (0.5 * g for g in o["grads"])
        want32 = g0 + g1
        want16 = (g0.bfloat16().float() + g1.bfloat16().float()).bfloat16().float()
        assert not torch.equal(want16, want32)  # the bf16 rounding is visible: the check below can fail
        for kind in ("reducer", "zero1", "zero2"):
            (got32, bytes32, padded), (got16, bytes16, _) = o[f"{kind}_None"], o[f"{kind}_torch.bfloat16"]
            assert bytes16 * 2 == bytes32 == padded * 4, f"{kind}: dp bytes {bytes16} vs {bytes32}"
            if kind == "reducer":
                lo, hi = 0, want32.numel()
            else:  # this rank's slice of the padded flat bucket
                S_ = padded // world
                lo, hi = r * S_, min((r + 1) * S_, want32.numel())
            assert torch.equal(got32[:hi - lo], want32[lo:hi]), kind
            assert torch.equal(got16[:hi - lo], want16[lo:hi]), kind


def test_peaks_follow_dtype(monkeypatch, tmp_path):
    """MFU divides by the GEMM peak of the compute dtype: the launcher's figure per dtype, the bf16 table of a
    CPU hardware profile (kept by save/load), the datasheet bf16 figure on GPU profiles."""
    monkeypatch.setenv(metrics.cpu_peak_env("fp32"), "1e11")
    monkeypatch.setenv(metrics.cpu_peak_env("bf16"), "5e11")
    cpu = torch.device("cpu")
    assert metrics.cpu_peak_flops(1, "fp32") == 1e11 and metrics.cpu_peak_flops(1, "bf16") == 5e11
    assert metrics.job_peak_flops(cpu, "bf16", 1, 1) == 5e11
    hw = dataclasses.replace(BUILTIN["cpu-gloo"], gemm_bf16_flops_by_threads={1: 600e9, 2: 1100e9})
    assert hw.peak_flops("bf16", 1) == 1100e9 and hw.peak_flops("bf16", 2) == 600e9
    assert hw.peak_flops("fp32", 1) == hw.gemm_flops_by_threads[2]
    assert BUILTIN["cpu-gloo"].peak_flops("bf16", 2) == BUILTIN["cpu-gloo"].peak_flops("fp32", 2)  # unmeasured
    save_hardware(hw, tmp_path / "hw.json")
    assert load_hardware(tmp_path / "hw.json").gemm_bf16_flops_by_threads == {1: 600e9, 2: 1100e9}
    assert BUILTIN["h100-sxm"].peak_flops("bf16") > 10 * BUILTIN["h100-sxm"].peak_flops("fp32")


def test_planner_reduce_bytes_follow_reduce_dtype():
    """The planner's DP all-reduce time uses 2-byte gradients under parallel.reduce_dtype=bf16."""
    from nanotitan.plan import predict
    from nanotitan.plan.shape import Layout

    lay = Layout(2, 1, 1, "1f1b", 1, 4)
    t = {rd: predict(load_config(None, ["--parallel.reduce_dtype", rd]), lay, BUILTIN["cpu-gloo"]).costs["dp_allreduce"]
         for rd in ("fp32", "bf16")}
    assert 0 < t["bf16"] < 0.6 * t["fp32"]


@pytest.mark.parametrize("args, field", [
    (["--parallel.reduce_dtype", "bf16", "--parallel.dp", "2", "--parallel.dp_impl", "torch_ddp"], "parallel.reduce_dtype"),
    (["--parallel.reduce_dtype", "bf16", "--parallel.dp", "2", "--parallel.zero", "3", "--train.ckpt_at_end", "false"],
     "parallel.reduce_dtype"),
    (["--parallel.reduce_dtype", "fp16"], "parallel.reduce_dtype"),
    (["--train.dtype", "fp16"], "train.dtype"),
])
def test_precision_options_fail_in_one_line(args, field):
    with pytest.raises(ConfigError) as e:
        load_config(None, args)
    assert field in str(e.value) and "\n" not in str(e.value)
