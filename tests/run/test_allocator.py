"""allocator.keep_freed_memory: a step's freed host memory is reused by the next step, not faulted in anew."""

import os
import platform
import subprocess
import sys

import pytest

PROBE = r"""
import resource, torch
from nanotitan.run.allocator import keep_freed_memory
from nanotitan.config.config import ModelConfig
from nanotitan.model.transformer import Transformer
on = keep_freed_memory()
torch.set_num_threads(1)
cfg = ModelConfig(vocab_size=2048, d_model=128, n_layers=2, n_heads=4, ffn_dim=256, num_experts=4, top_k=2,
                  max_seq_len=128)
model, x = Transformer(cfg, None, 0), torch.randint(0, 2048, (4, 128))
def step():
    ce, aux = model(x, x)
    (ce + aux).backward()
for _ in range(3):
    step()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(on, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="glibc's malloc only")


def probe(**env) -> tuple[bool, int]:
    full = {k: v for k, v in os.environ.items() if not (k.startswith("MALLOC_") or k == "NANOTITAN_MALLOC")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**full, **env}, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    return out[0] == "True", int(out[1])


@glibc
def test_freed_memory_is_reused_not_faulted_in_again():
    on, faults = probe()
    off, faults_off = probe(NANOTITAN_MALLOC="system")
    assert on and not off
    # Untuned, the steps' larger tensors (logits, their gradients, the experts' stacked weight gradients) are
    # fresh mmaps or a trimmed heap top, faulted in page by page every step: 7.7k-26k faults in these 20 steps
    # here, against 1.9k-3.4k tuned (what remains is the process's own growth).
    assert faults * 1.5 < faults_off, (faults, faults_off)


@glibc
def test_the_users_own_tunables_are_left_alone():
    on, _ = probe(MALLOC_ARENA_MAX="2")
    assert not on
