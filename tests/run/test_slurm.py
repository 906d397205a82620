"""Slurm without a wrapper script: the node list is expanded as Slurm writes it, every node derives the same
rendezvous from Slurm's variables, misuse fails in one line, and two `nanotitan train` tasks with Slurm's
variables set (two "nodes" on loopback) train the same losses as one process."""

import json
import os
import subprocess
import sys

import pytest

from nanotitan.config.config import ConfigError, load_config
from nanotitan.run.launch import Rendezvous, expand_nodelist, slurm_rendezvous
from tests.helpers.tiny import tiny_args


@pytest.mark.parametrize("spec,hosts", [
    ("node[01-03],gpu7", ["node01", "node02", "node03", "gpu7"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[08-10,12]", ["n08", "n09", "n10", "n12"]),
    ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
    ("a1,b[2-3].cluster,127.0.0.1", ["a1", "b2.cluster", "b3.cluster", "127.0.0.1"]),
    ("localhost", ["localhost"]),
])
def test_expand_nodelist(spec, hosts):
    assert expand_nodelist(spec) == hosts


def _srun_env(node: int, **extra) -> dict:
    """What `srun --nodes 2 --ntasks-per-node 1` exports to the task on node `node` (the part we read)."""
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NNODES": "2", "SLURM_NODEID": str(node),
           "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1",
           "SLURM_GPUS_ON_NODE": "4"}
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def test_every_node_derives_the_same_rendezvous():
    r0, r1 = slurm_rendezvous(8, _srun_env(0)), slurm_rendezvous(8, _srun_env(1))
    assert r0 == Rendezvous(nnodes=2, node_rank=0, nproc_per_node=4, endpoint=r0.endpoint, run_id=r0.run_id)
    assert r1.node_rank == 1 and (r1.endpoint, r1.run_id) == (r0.endpoint, r0.run_id)
    host, port = r0.endpoint.split(":")
    assert host == "gpu07" and 20000 <= int(port) < 40000 and "4242" in r0.run_id
    assert slurm_rendezvous(8, _srun_env(1, MASTER_PORT="29555")).endpoint == "gpu07:29555"
    assert "--rdzv-conf=is_host=1" in r0.torchrun_args() and "--rdzv-conf=is_host=0" in r1.torchrun_args()
    # not under Slurm, one node, or already under torchrun: nothing to set up
    assert slurm_rendezvous(8, {}) is None
    assert slurm_rendezvous(4, _srun_env(0, SLURM_NNODES="1", SLURM_NTASKS="1", SLURM_JOB_NODELIST="gpu07")) is None
    assert slurm_rendezvous(8, _srun_env(0, RANK="0", WORLD_SIZE="8")) is None


@pytest.mark.parametrize("world,extra,words", [
    (8, {"SLURM_STEP_ID": None}, "not inside srun"),
    (8, {"SLURM_NTASKS_PER_NODE": "4", "SLURM_NTASKS": "8"}, "--ntasks-per-node 1"),
    (7, {}, "do not split evenly"),
    (16, {}, "SLURM_GPUS_ON_NODE=4"),
    (8, {"SLURM_JOB_NODELIST": "gpu7"}, "does not have SLURM_NNODES=2"),
])
def test_misuse_fails_in_one_line(world, extra, words):
    with pytest.raises(ConfigError) as e:
        slurm_rendezvous(world, _srun_env(0, **extra))
    assert words in str(e.value) and "\n" not in str(e.value)


TINY = tiny_args("seq_len", "micro_batch", n_layers=2) + [
        "--run.progress", "false", "--run.tensorboard", "false", "--train.sample_tokens", "0",
        "--train.steps", "4", "--train.warmup_steps", "1", "--run.log_every", "1", "--train.eval_every", "0",
        "--train.ckpt_at_end", "false", "--train.threads", "1"]


def _losses(run_dir) -> dict:
    recs = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def test_two_slurm_nodes_on_loopback_train_like_one_process(tmp_path, corpus_dir):
    """`srun --nodes 2 --ntasks-per-node 1 nanotitan train --parallel.dp 2` simulated on one machine: each task
    becomes its node's torchrun agent and they meet at the first node of SLURM_JOB_NODELIST."""
    from nanotitan.train import run
    from tests.helpers.mp import free_port, outputs_of

    common = [*TINY, "--data.source", str(corpus_dir)]
    ref = load_config(None, [*common, "--parallel.microbatches", "2", "--run.dir", str(tmp_path / "one")])
    run(ref)  # one process, same B = dp*M*m = 4 sequences; also prepares the data the nodes read
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))
            and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    port = str(free_port())
    cmd = [sys.executable, "-m", "nanotitan.cli", "train", *common, "--parallel.dp", "2",
           "--run.dir", str(tmp_path / "two")]
    nodes = [subprocess.Popen(cmd, env=dict(base, **_srun_env(n, SLURM_JOB_NODELIST="127.0.0.1,127.0.0.1",
                                                              SLURM_GPUS_ON_NODE=None, MASTER_PORT=port)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in (0, 1)]
    outs = outputs_of(nodes, 150)
    assert all(p.returncode == 0 for p in nodes), "\n".join(outs)
    # rank 0 (the one that logs) ran on one node only: a standalone launch on each node would run it twice
    assert sorted("[rank0]:" in out for out in outs) == [False, True], outs
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert sorted(two) == [1, 2, 3, 4] and sorted(one) == sorted(two)
    for step in one:
        assert abs(two[step] - one[step]) <= 1e-5 * abs(one[step]), (step, one[step], two[step])
