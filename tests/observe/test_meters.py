"""The memory figures are true (issue 39 item 3): the meters count what is live, checked against glibc's heap.

Units: a FakeTensor (DTensor's sharding propagation makes them on the CPU device, with meta storage) is no memory;
a saved storage that FSDP2-style `resize_(0)` frees counts as freed; parameters, FSDP2's gathered ones included,
are not saved activations; the trainer meters its first steady step. Multi-rank: every zero level's step peak
against the heap's rise over the same step (the bench's worker and the trainer's own meters, first and steady
step), and the trainer's zero 3 / zero 0 peak against `nanotitan bench dp --zero`'s.
"""

import contextlib
import json

import pytest
import torch

from nanotitan.observe.memory import HeapInUse, PeakTensorBytes, SavedActivations, StepMeters, heap_in_use

needs_glibc = pytest.mark.skipif(heap_in_use() is None, reason="needs glibc's mallinfo2 (Linux, glibc 2.33+)")


def test_a_fake_tensor_is_no_memory():
    """Under FakeTensorMode a factory call says device cpu, but its storage is meta: nothing is counted (at zero 3's
    first step DTensor's propagation made 4x the parameters of them, issue 39)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    meter = PeakTensorBytes(torch.device("cpu"))
    with meter:
        start = meter.live()
        with FakeTensorMode():
            fake = torch.empty_strided((1000, 1000), (1000, 1), dtype=torch.float32, device="cpu")
        assert fake.device.type == "cpu" and fake.untyped_storage().device.type == "meta"
        real = torch.empty(1000)
        assert meter.live() == start + 4000
        del real
    assert meter.peak == start + 4000


def test_a_saved_storage_freed_by_a_resize_counts_as_freed():
    """FSDP2 frees with storage.resize_(0) and re-gathers with resize_(n): the saved-activation figure follows the
    storage's current size both ways, and the peak saw the most that was live."""
    a = torch.randn(1000, requires_grad=True)
    b = torch.randn(2000)
    meter = SavedActivations()
    with meter:
        y = a * b[:1000]  # saves b's view (for a's gradient): b's whole storage, 8000 bytes
        assert meter.bytes == 8000
        b.untyped_storage().resize_(0)
        assert meter.bytes == 0
        b.untyped_storage().resize_(4000)  # half of it back
        assert meter.bytes == 4000
        b.untyped_storage().resize_(8000)
        y.sum().backward()
    assert meter.bytes == 0 and meter.peak_bytes == 8000


def test_parameters_are_not_activations_however_they_are_gathered():
    """A parameter made after the meter (FSDP2 gathers into an nn.Parameter of its own each unshard) and its views
    (the experts' W.unbind(0)) are not counted; the activation beside them is."""
    model = torch.nn.Linear(4, 4)  # alive as long as the meter, as a trainer's model (its storages' keys stay its)
    meter = SavedActivations(model)
    gathered = torch.nn.Parameter(torch.randn(3, 64, 32))
    x = torch.randn(16, 64, requires_grad=True)
    with meter:
        y = sum((x @ w).sum() for w in gathered.unbind(0))  # saves x (counted) and the views of `gathered`
        assert meter.bytes == 16 * 64 * 4
        y.backward()
    assert meter.bytes == 0 and meter.peak_bytes == 16 * 64 * 4


def test_the_first_two_steps_are_metered():
    """Steps 1 and 2 (the first steady one: AdamW's moments exist from step 2 on) and the 1st and every
    peak_every-th logged step."""
    model = torch.nn.Linear(2, 2)  # its 24 bytes live through every step
    meters = StepMeters(model, torch.device("cpu"), peak_every=2)
    logged = [True, False, False, True, False, True, True, False, True]
    metered = []
    for lg in logged:
        with meters.step(lg) as m:
            metered.append(m)
    assert metered == [True, True, False, False, False, True, False, False, True]
    assert meters.take_interval_peak() >= 24 and meters.take_interval_peak() is None


# --- against the allocator, at every zero level ---------------------------------------------------------------
SMALL = dict(vocab_size=1024, d_model=128, n_layers=2, n_heads=4, ffn_dim=256, num_experts=4, top_k=2,
             max_seq_len=64)
BATCH = 4
MODES = ("zero0", "zero1", "zero2", "zero3")


def _bench_rows(world: int) -> dict:
    """`nanotitan bench dp --zero`'s worker (observe/dp_modes.py) on the small model: each mode's bytes, max over
    ranks (a spawn per mode, as the bench: a mode's count starts from a process that held no other mode's model)."""
    from nanotitan.observe.dp_modes import zero_worker
    from nanotitan.config.config import ModelConfig
    from tests.helpers.mp import run_ranks

    rows = {}
    for mode in MODES:
        out = run_ranks(zero_worker, world, (mode, 25.0, 0, 1, 1, ModelConfig(**SMALL), BATCH), timeout=600)
        rows[mode] = {k: max(o[2][k] for o in out) for k in out[0][2]}
    return rows


def _train_metered(rank, world, args):
    """The trainer, with glibc's heap sampled over each metered step: [(count start, count peak, heap start,
    heap peak)] per metered step, and the run's summary row of this rank."""
    from nanotitan.config.config import load_config
    from nanotitan.observe import memory
    from nanotitan.train import run

    steps, step = [], memory.StepMeters.step

    @contextlib.contextmanager
    def heap_too(self, logged):
        with step(self, logged) as metered:
            heap = HeapInUse() if metered else contextlib.nullcontext()
            with heap:
                yield metered
        if metered:
            steps.append((self.step_peak.start, self.step_peak.peak, heap.start, heap.peak))

    memory.StepMeters.step = heap_too
    out = run(load_config(None, args))
    return steps, out["summary"]["ranks"][rank]


def _trainer_args(corpus_dir, run_dir, world: int, zero: int) -> list[str]:
    model = [a for k, v in SMALL.items() if k not in ("vocab_size", "max_seq_len") for a in (f"--model.{k}", str(v))]
    return model + ["--data.vocab_size", str(SMALL["vocab_size"]), "--train.seq_len", str(SMALL["max_seq_len"]),
                    "--train.micro_batch", str(BATCH), "--parallel.dp", str(world), "--parallel.zero", str(zero),
                    "--data.source", str(corpus_dir), "--run.dir", str(run_dir), "--train.steps", "3",
                    "--run.log_every", "3", "--run.progress", "false", "--run.tensorboard", "false",
                    "--train.sample_tokens", "0", "--train.ckpt_at_end", "false", "--train.eval_every", "0"]


def _near(a: float, b: float, rel: float) -> bool:
    return abs(a / b - 1) <= rel


@needs_glibc
def test_step_peaks_agree_with_the_heap_and_the_trainer_with_the_bench(corpus_dir, tmp_path):
    """At DP2, zero 0-3: the bench's step peak and the heap's figure (count start + heap rise) within 10%, the
    saved activations the same at every level (parameters, gathered or not, are not activations); the trainer's
    metered steps (the first, with AdamW's and FSDP2's lazy set-up, and the first steady one) within 10% of the
    heap's at zero 0 and 3; summary.json's zero 3 / zero 0 peak within 5% of the bench's."""
    from tests.helpers.mp import run_ranks

    world = 2
    bench = _bench_rows(world)
    acts0 = bench["zero0"]["act_peak_bytes"]
    for mode, row in bench.items():
        assert _near(row["heap_peak_bytes"], row["peak_tensor_bytes"], 0.10), (mode, row)
        assert _near(row["act_peak_bytes"], acts0, 0.01), (mode, row["act_peak_bytes"], acts0)
    summary = {}
    for zero in (0, 3):
        out = run_ranks(_train_metered, world, (_trainer_args(corpus_dir, tmp_path / f"z{zero}", world, zero),),
                        timeout=600)
        for steps, row in out:
            assert len(steps) == 2, steps  # steps 1 and 2 (run.peak_every 10: step 3 is the 2nd logged one)
            # The first step's heap also grows by what is set up once and is no tensor (kernel and collective
            # caches: +9.5 MiB over 12 MiB of tensors at zero 0 here), so there the count may only not exceed it
            # (before issue 39 it did at zero 3: DTensor's fake arguments, 4x the parameters); the steady step agrees.
            (s1, p1, h1, hp1), (s2, p2, h2, hp2) = steps
            assert p1 <= 1.10 * (s1 + hp1 - h1), (zero, steps)
            assert _near(s2 + hp2 - h2, p2, 0.10), (zero, steps)
            assert row["peak_tensor_bytes"] == max(p for _, p, _, _ in steps)
            assert _near(row["act_peak_bytes"], acts0, 0.05), (zero, row["act_peak_bytes"], acts0)
        summary[zero] = max(row["peak_tensor_bytes"] for _, row in out)
        on_disk = json.loads((tmp_path / f"z{zero}" / "summary.json").read_text())["ranks"]
        assert max(r["peak_tensor_bytes"] for r in on_disk) == summary[zero]
    bench_ratio = bench["zero3"]["peak_tensor_bytes"] / bench["zero0"]["peak_tensor_bytes"]
    assert _near(summary[3] / summary[0], bench_ratio, 0.05), (summary, bench_ratio)
