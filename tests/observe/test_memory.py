"""Memory that means something per layout: live bytes of parameters, gradients and optimizer state (each
storage once: gradients are views of flat buffers), and the peak bytes autograd keeps for backward."""

import gc

import pytest
import torch

from nanotitan.config.config import load_config
from nanotitan.observe.memory import SavedActivations, live_tensor_bytes
from nanotitan.resolve import resolve
from tests.helpers.tiny import tiny_args

TINY = tiny_args(n_layers=2)


def test_live_tensor_bytes_counts_each_storage_once():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    flat = torch.zeros(n)  # the Reducer's bucket: every .grad is a view of it
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    assert live_tensor_bytes(model, opt) == {"param_bytes": 4 * n, "grad_bytes": 4 * n, "optim_bytes": 0}
    opt.step()
    # exp_avg and exp_avg_sq per parameter, plus a float32 `step` per parameter tensor
    assert live_tensor_bytes(model, opt)["optim_bytes"] == 2 * 4 * n + 4 * len(params)
    # ZeRO-style: the optimizer updates a flat shard of its own (its master copy counts as optimizer state)
    shard = torch.zeros(10, requires_grad=True)
    shard.grad = torch.zeros(10)
    zero = torch.optim.AdamW([shard])
    zero.step()
    assert live_tensor_bytes(model, zero) == {"param_bytes": 4 * n, "grad_bytes": 4 * n + 40,
                                              "optim_bytes": 40 + 2 * 40 + 4}


def test_saved_activations_of_a_linear_relu():
    """mm saves its input (and the weight: a parameter, not counted), relu its output; backward frees both."""
    lin = torch.nn.Linear(64, 128, bias=False)
    meter = SavedActivations(lin)
    x = torch.randn(32, 64, requires_grad=True)
    with meter:
        y = lin(x).relu()
        y2 = lin(x).relu()  # x again: its storage is already counted
        assert meter.bytes == 32 * 64 * 4 + 2 * 32 * 128 * 4
        (y.sum() + y2.sum()).backward()
    assert meter.bytes == 0 and meter.peak_bytes == 32 * 64 * 4 + 2 * 32 * 128 * 4
    meter.reset_peak()
    assert meter.peak_bytes == 0


def _moe_step(xs: torch.Tensor, interleave: bool, checkpointing: bool = False, metered: bool = True):
    """Gradients and saved-activation peak of the microbatches xs (M, m, S): all forwards then all backwards
    (GPipe's order) or forward+backward per microbatch (what 1F1B does on one stage)."""
    import contextlib

    from tests.helpers.specs import build_shard_spec
    from nanotitan.model.transformer import Transformer

    cfg = resolve(load_config(None, TINY))
    model = Transformer(cfg.model, build_shard_spec(cfg), seed=0)
    model.activation_checkpointing = checkpointing
    meter = SavedActivations(model)
    with meter if metered else contextlib.nullcontext():
        losses = []
        for x in xs:
            ce, aux = model(x, x)
            losses.append(ce + 0.01 * aux)
            if interleave:
                losses.pop().backward()
        for loss in losses:
            loss.backward()
    assert meter.bytes == 0  # backward released everything (no graph kept alive by the meter)
    return [p.grad.clone() for p in model.parameters()], meter.peak_bytes


def test_saved_activation_peak_follows_the_schedule_and_leaves_gradients_alone():
    xs = torch.randint(0, 300, (4, 4, 16), generator=torch.Generator().manual_seed(0))
    g_plain, _ = _moe_step(xs, interleave=False, metered=False)
    g_all, all_first = _moe_step(xs, interleave=False)
    singles = [_moe_step(xs[i:i + 1], interleave=False)[1] for i in range(len(xs))]
    _, interleaved = _moe_step(xs, interleave=True)
    _, ckpt = _moe_step(xs, interleave=False, checkpointing=True)
    assert all(torch.equal(a, b) for a, b in zip(g_plain, g_all))  # the hooks change what autograd stores only
    assert 0.9 * sum(singles) < all_first <= sum(singles)  # all four held at once (shared buffers counted once)
    assert interleaved == max(singles)  # one at a time
    assert ckpt < all_first / 2  # checkpointing keeps the block inputs only


# --- the high-water mark of every live tensor during a step (memory.PeakTensorBytes) -------------------------

def test_step_peak_counts_storages_created_resized_and_freed():
    """On CPU: what was live on entry, plus each storage an op creates until it is freed, each storage once (a view
    adds nothing), and storage resizes (how FSDP2 frees and re-gathers its unsharded params) both ways."""
    from nanotitan.observe.memory import PeakTensorBytes

    gc.collect()  # earlier tests' cyclic garbage (1.5 MB of tensors after the one above) must not be freed inside
    before = torch.zeros(1000)  # 4000 bytes live on entry (among whatever else this process holds)
    meter = PeakTensorBytes(torch.device("cpu"))
    with meter:
        start = meter.live()
        assert start == meter.start and start >= 4000
        a = torch.ones(2000)  # +8000
        view = a[10:]  # the same storage: +0
        b = a * 2  # +8000: the peak so far, start + 16000
        assert meter.live() == start + 16000
        del a, view, b  # -16000
        before.untyped_storage().resize_(0)  # -4000: the entry's storage, freed by a resize
        assert meter.live() == start - 4000
        before.untyped_storage().resize_(12000)  # +12000
        c = torch.empty(5000)  # +20000: the peak, start + 28000
        del c
        assert meter.live() == start + 8000
    assert meter.peak == start + 28000


def test_step_peak_is_not_raised_by_garbage_freed_as_the_meter_opens(monkeypatch):
    """A garbage collection while the meter opens (it allocates) frees storages the entry scan counted: the peak
    starts from what is live once the window is open, not from before that collection."""
    from nanotitan.observe import memory
    from nanotitan.observe.memory import PeakTensorBytes

    class Cycle:
        pass

    gc.collect()
    a, b = Cycle(), Cycle()
    a.other, b.other, a.t = b, a, torch.zeros(64000)  # 256 KB that only the collector frees
    del a, b
    watch = memory.watch_resizes

    def watch_and_collect(watcher):  # the collection lands where opening the window allocates
        gc.collect()
        watch(watcher)
    monkeypatch.setattr(memory, "watch_resizes", watch_and_collect)
    with PeakTensorBytes(torch.device("cpu")) as meter:
        start = meter.live()
        c = torch.empty(5000)  # +20000: the window's peak
        del c
    assert start == meter.start and meter.peak == start + 20000


def test_step_peak_sees_through_the_autograd_engine():
    """Gradients autograd creates and the activations it saves are counted; what backward frees leaves the count."""
    from nanotitan.observe.memory import PeakTensorBytes

    lin = torch.nn.Linear(256, 256, bias=False)
    x = torch.randn(64, 256)
    meter = PeakTensorBytes(torch.device("cpu"))
    with meter:
        y = lin(x).relu()  # +64 KiB output of the matmul (saved? relu saves its output: the same storage)
        y.sum().backward()  # + the weight's gradient (256 KiB) and transient gradients of y
        after = meter.live()
    assert after - meter.start == 64 * 256 * 4 + 256 * 256 * 4  # y (alive) + lin.weight.grad (alive)
    assert meter.peak >= after + 64 * 256 * 4  # dL/dy existed during backward


def _train(rank, world, args):
    from nanotitan.train import run

    run(load_config(None, args))


def test_trainer_reports_the_step_peak(corpus_dir, tmp_path):
    """Every record carries the high-water mark of its metered step (max over ranks), summary.json each rank's
    run maximum beside its steady state; the peak holds the state, the saved activations and more at once.
    In a process of its own, as a run is: the peak counts every live tensor of the process, and pytest's holds
    the tensors of other tests' fixtures."""
    import json

    from tests.helpers.mp import run_ranks

    args = TINY + ["--data.source", str(corpus_dir), "--run.dir", str(tmp_path), "--train.steps", "4",
                   "--run.log_every", "2", "--run.peak_every", "1", "--train.seq_len", "16", "--train.micro_batch", "2",
                   "--parallel.microbatches", "2", "--run.progress", "false", "--run.tensorboard", "false",
                   "--train.sample_tokens", "0", "--train.ckpt_at_end", "false", "--train.eval_every", "0"]
    run_ranks(_train, 1, (args,), timeout=120)
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (row,) = json.loads((tmp_path / "summary.json").read_text())["ranks"]
    assert [r["step"] for r in recs] == [1, 2, 4] and all(r["peak_tensor_bytes"] > 0 for r in recs)
    assert row["peak_tensor_bytes"] == max(r["peak_tensor_bytes"] for r in recs)
    steady = row["param_bytes"] + row["grad_bytes"] + row["optim_bytes"]
    # AdamW's moments exist from step 2 on; the activations' peak is the run's (routing varies a little per step)
    assert row["peak_tensor_bytes"] >= steady + 0.9 * row["act_peak_bytes"], row
    assert row["peak_tensor_bytes"] < 4 * (steady + row["act_peak_bytes"]), row  # a count, not RSS


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the allocator's own high-water mark")
def test_step_peak_counter_matches_the_cuda_allocator():
    """The CPU method (counting storages as ops create, resize and free them) against a real allocator's counters:
    a training step of the MID model on CUDA, measured both ways on two identical steps, agrees within 3% of the
    step's rise above its start (the caching allocator rounds every block up to 512 bytes; cuBLAS workspaces)."""
    from nanotitan.config.config import ModelConfig
    from nanotitan.observe.memory import PeakTensorBytes, _TensorCounter
    from nanotitan.model.transformer import Transformer

    cfg = ModelConfig(vocab_size=4096, d_model=256, n_layers=4, n_heads=4, ffn_dim=512, num_experts=8, top_k=2,
                      max_seq_len=128)
    model = Transformer(cfg, seed=0).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tok = torch.randint(0, cfg.vocab_size, (8, 129), device="cuda")

    def step():
        ce, aux = model(tok[:, :-1], tok[:, 1:])
        (ce + 0.01 * aux).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # AdamW's moments exist from here on, as in every later step
    torch.cuda.synchronize()
    allocator = PeakTensorBytes(torch.device("cuda"))
    with allocator:
        step()
    torch.cuda.synchronize()
    counter = _TensorCounter("cuda")
    with counter:
        start = counter.current
        step()
    torch.cuda.synchronize()
    rise_alloc, rise_count = allocator.peak - allocator.start, counter.peak - start
    print(f"peak rise over the step: allocator {rise_alloc / 2**20:.1f} MiB, counter {rise_count / 2**20:.1f} MiB; "
          f"start: allocator {allocator.start / 2**20:.1f} MiB, counted tensors {start / 2**20:.1f} MiB")
    assert rise_alloc > 50 * 2**20, rise_alloc  # activations, gradients, logits: a real step
    assert abs(rise_count / rise_alloc - 1) < 0.03, (rise_count, rise_alloc)
    # on entry the allocator also holds what no tensor shows (cuBLAS workspaces): the counter never sees more
    assert start <= allocator.start, (start, allocator.start)
