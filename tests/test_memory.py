"""Memory that means something per layout: live bytes of parameters, gradients and optimizer state (each
storage once: gradients are views of flat buffers), and the peak bytes autograd keeps for backward."""

import torch

from nanotitan.config import load_config
from nanotitan.metrics import SavedActivations, live_tensor_bytes
from nanotitan.resolve import resolve

TINY = ["--model.d_model", "32", "--model.n_heads", "4", "--model.ffn_dim", "48", "--model.n_layers", "2",
        "--model.num_experts", "4", "--data.vocab_size", "300"]


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

    from nanotitan.model.spec import build_shard_spec
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
