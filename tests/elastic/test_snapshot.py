"""Snapshots (snapshot.py): a snapshot holds the state of its step even though training goes on while it is
written; a node's unit copied to a peer's transport is checked before it is kept; a step whose owner's snapshot
dir is gone is assembled from the peer's replica, and one with a shard on no surviving node is passed over."""

import json

import pytest
import torch

from nanotitan.elastic.replicas import assemble_newest
from tests.helpers.equivalence import base_args, layout_args

KEY = b"k" * 32  # the job's MAC key (auth.py)


def test_snapshot_is_the_state_of_its_step_while_training_goes_on(corpus_dir, tmp_path):
    from nanotitan.state import checkpoint as ckpt
    from nanotitan.elastic import snapshot
    from nanotitan.config.config import load_config
    from nanotitan.train import Trainer

    torch.set_num_threads(1)
    args = base_args(corpus_dir, tmp_path / "run") + layout_args(1, 1, 1) + ["--train.steps", "4"]
    ref = Trainer(load_config(None, base_args(corpus_dir, tmp_path / "ref") + layout_args(1, 1, 1)
                              + ["--train.steps", "3"]))
    ref.train()
    tr = Trainer(load_config(None, args))
    for step in range(2):
        tr.train_step(step)
    writer = snapshot.SnapshotWriter(tr.cfg, tmp_path / "shm", node=0, gen=1, leader=True, timeout_s=60)
    for step in (2, 3):  # the second reuses the first's DCP plan (plan caching)
        writer.start(step, tr.model, tr.optimizer, tr.shard, ckpt.layout_dict(tr.dims), step * tr.B)
        tr.train_step(step)  # mutates the live state while the thread may still be writing
    writer.wait()
    assert (tmp_path / "shm" / "step_2" / "g1-node0" / "manifest.json").is_file()
    path = assemble_newest(tmp_path / "shm", {}, KEY, -1, print)
    assert path == tmp_path / "shm" / "checkpoints" / "step_3"
    loaded = Trainer(load_config(None, base_args(corpus_dir, tmp_path / "load") + layout_args(1, 1, 1)
                                 + ["--train.steps", "4", "--train.resume", str(path)]))
    assert loaded.start_step == 3
    want = dict(ref.model.named_parameters())
    for name, t in loaded.model.named_parameters():
        torch.testing.assert_close(t, want[name], rtol=0, atol=0, msg=lambda s: f"{name}: {s}")


def _unit(root, step, node, shards: dict[str, bytes], manifest_shards: dict[str, bytes]):
    """A committed unit of generation 1 holding `shards`, with a manifest naming `manifest_shards` (every node's)."""
    import xxhash

    d = root / f"step_{step}" / f"g1-node{node}"
    d.mkdir(parents=True)
    small = {".metadata": b"meta", "state.json": json.dumps({"step": step}).encode()}
    for name, data in {**shards, **small}.items():
        (d / name).write_bytes(data)
    files = {n: {"bytes": len(b), "xxh3_64": xxhash.xxh3_64_hexdigest(b)} for n, b in {**manifest_shards, **small}.items()}
    (d / "manifest.json").write_text(json.dumps({"format": 2, "files": files}))
    return d


def test_a_lost_nodes_shards_come_from_its_replica(tmp_path):
    from nanotitan.elastic import transport
    from nanotitan.state.manifest import verify_checkpoint

    root0, root1 = tmp_path / "node0", tmp_path / "node1"
    server0, server1 = transport.FileServer("127.0.0.1", KEY, "job"), transport.FileServer("127.0.0.1", KEY, "job")
    server0.root, server1.root, server0.node, server1.node = root0, root1, 0, 1
    node0, node1 = (transport.Peer(f"127.0.0.1:{s.port}", "job", n) for n, s in enumerate((server0, server1)))
    try:
        shards = {"__0_0.raw": b"a" * 1000, "__1_0.raw": b"b" * 3000}
        for step in (10, 15):
            _unit(root0, step, 0, {"__0_0.raw": shards["__0_0.raw"]}, shards)
            _unit(root1, step, 1, {"__1_0.raw": shards["__1_0.raw"]}, shards)
        # node 1 pushed its step-10 unit to node 0 (its step-15 one was not copied yet when it was lost)
        transport.push_unit(node0, KEY, root1 / "step_10" / "g1-node1", "step_10/g1-node1")
        assert sorted(transport.list_units(node0, KEY)) == [
            "step_10/g1-node0", "step_10/g1-node1", "step_15/g1-node0"]

        # A damaged copy is refused by the peer and nothing of it is kept.
        bad = root1 / "step_15" / "g1-node1" / "__1_0.raw"
        bad.write_bytes(b"c" * 3000)
        with pytest.raises(OSError, match="refused: __1_0.raw fails its checksum"):
            transport.push_unit(node0, KEY, bad.parent, "step_15/g1-node1")
        assert not (root0 / "step_15" / "g1-node1").exists()

        # Node 1 is lost with its snapshot dir: step 15 lacks its shard, step 10 is whole from node 0's replica.
        import shutil

        shutil.rmtree(root1)
        said = []
        path = assemble_newest(root0, {1: node1}, KEY, -1, said.append)
        assert path == root0 / "checkpoints" / "step_10", said
        assert said == ["resume: skipped snapshot step_15 (generation 1): __1_0.raw is on no node that answers"]
        assert verify_checkpoint(path) == ""
        assert (path / "__1_0.raw").read_bytes() == shards["__1_0.raw"]

        # Another node fetches node 0's assembled copy into its own dir.
        got = transport.fetch_checkpoint(node0, KEY, tmp_path / "node2", 10)
        assert verify_checkpoint(got) == ""
    finally:
        server0.close()
        server1.close()


def _snapshot_and_save(rank, world, args, shm):
    """A rank of (2,1,2) at zero 1: trains 3 steps, then takes a snapshot and a DCP checkpoint of the same state,
    and trains on while the snapshot's thread writes."""
    from nanotitan.state import checkpoint as ckpt
    from nanotitan.elastic import snapshot
    from nanotitan.config.config import load_config
    from nanotitan.train import Trainer

    tr = Trainer(load_config(None, args))
    for step in range(3):
        tr.train_step(step)
    writer = snapshot.SnapshotWriter(tr.cfg, shm, node=0, gen=1, leader=rank == 0, timeout_s=60)
    writer.start(3, tr.model, tr.optimizer, tr.shard, ckpt.layout_dict(tr.dims), 3 * tr.B)
    tr.save(3)
    tr.train_step(3)
    writer.wait()
    return writer.packing.length


def test_a_snapshot_reshards_as_its_checkpoint_does(corpus_dir, tmp_path):
    """A snapshot of 4 ranks at (dp=2, ep=2, zero 1), raw shards each written by one holder of each piece, loads
    into one process (another layout and zero level) bit for bit as the DCP checkpoint of the same state does."""
    from nanotitan.elastic import snapshot
    from nanotitan.config.config import load_config
    from nanotitan.train import Trainer
    from tests.helpers.mp import run_ranks

    args = base_args(corpus_dir, tmp_path / "run") + layout_args(2, 1, 2) + ["--parallel.zero", "1",
                                                                           "--train.steps", "4"]
    lengths = run_ranks(_snapshot_and_save, 4, args=(args, tmp_path / "shm"), timeout=300)
    path = assemble_newest(tmp_path / "shm", {}, KEY, -1, print)
    assert path == tmp_path / "shm" / "checkpoints" / "step_3"
    assert sorted(f.name for f in path.glob("__*")) == [f"__{r}_0.raw" for r in range(4)]
    # the replicas split the work: no rank writes much more than its share
    assert max(lengths) < 0.6 * sum(lengths), lengths

    torch.set_num_threads(1)
    single = base_args(corpus_dir, tmp_path / "load") + layout_args(1, 1, 1) + ["--train.steps", "4"]
    from_snapshot = Trainer(load_config(None, single + ["--train.resume", str(path)]))
    from_ckpt = Trainer(load_config(None, single + ["--train.resume", str(tmp_path / "run" / "checkpoints" / "step_3")]))
    assert from_snapshot.start_step == from_ckpt.start_step == 3
    want = dict(from_ckpt.model.named_parameters())
    for name, t in from_snapshot.model.named_parameters():
        torch.testing.assert_close(t, want[name], rtol=0, atol=0, msg=lambda s: f"{name}: {s}")
        for k, v in from_snapshot.optimizer.state[t].items():
            torch.testing.assert_close(v, from_ckpt.optimizer.state[want[name]][k], rtol=0, atol=0,
                                       msg=lambda s: f"{name}.{k}: {s}")


def test_a_nonfinite_state_is_never_committed(corpus_dir, tmp_path):
    """A state holding NaN is not kept: the snapshot fails with one line naming the key, and no unit appears."""
    from nanotitan.state import checkpoint as ckpt
    from nanotitan.elastic import snapshot
    from nanotitan.config.config import load_config
    from nanotitan.train import Trainer

    torch.set_num_threads(1)
    tr = Trainer(load_config(None, base_args(corpus_dir, tmp_path / "run") + layout_args(1, 1, 1)))
    tr.train_step(0)
    writer = snapshot.SnapshotWriter(tr.cfg, tmp_path / "shm", node=0, gen=1, leader=True, timeout_s=60)
    writer.start(1, tr.model, tr.optimizer, tr.shard, ckpt.layout_dict(tr.dims), tr.B)
    writer.wait()
    name, p = next(iter(tr.model.named_parameters()))
    with torch.no_grad():
        p.view(-1)[3] = float("nan")
    writer.start(2, tr.model, tr.optimizer, tr.shard, ckpt.layout_dict(tr.dims), 2 * tr.B)
    writer.thread.join()
    assert writer.error == f"snapshot of step 2 not kept: rank 0: model.{name} holds NaN/inf"
    assert snapshot.units(tmp_path / "shm") == {"step_1/g1-node0": [
        ".metadata", "__0_0.raw", "config.toml", "manifest.json", "state.json"]}


def _snapshot_on_a_full_disk(rank, world, args, shm):
    """A rank of pp=2, each rank its own node (its own snapshot dir): rank 1's writes fail as on a full disk
    (RLIMIT_FSIZE 1 KiB: EFBIG) while it snapshots step 3; then, its disk back, both save a DCP checkpoint of the
    same state. Returns what the snapshot's thread said."""
    import resource

    from nanotitan.state import checkpoint as ckpt
    from nanotitan.elastic import snapshot
    from nanotitan.config.config import load_config
    from nanotitan.train import Trainer

    tr = Trainer(load_config(None, args))
    for step in range(3):
        tr.train_step(step)
    writer = snapshot.SnapshotWriter(tr.cfg, shm / f"node{rank}", node=rank, gen=1, leader=True, timeout_s=60)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limit[1]))
    writer.start(3, tr.model, tr.optimizer, tr.shard, ckpt.layout_dict(tr.dims), 3 * tr.B)
    writer.thread.join()
    said = [writer.error, writer.note]
    resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    tr.save(3)
    return said


def test_a_full_disk_on_one_node_during_a_snapshot_keeps_the_snapshot(corpus_dir, tmp_path):
    """Rank 1's shard cannot be written on its node (a full disk): it is sent to rank 0 on the other node, which
    writes it into its node's unit, checked against the checksum of the buffer it came from. The snapshot is whole
    (was: `snapshot of step 3 not kept`, so a failure soon after fell back a snapshot more: up to 2K steps), and it
    loads bit for bit as the checkpoint of the same state. Rank 1's node commits no unit of its own."""
    from nanotitan.config.config import load_config
    from nanotitan.elastic import snapshot
    from nanotitan.train import Trainer
    from tests.helpers.mp import run_ranks

    args = base_args(corpus_dir, tmp_path / "run") + layout_args(1, 2, 1) + ["--train.steps", "4"]
    said = run_ranks(_snapshot_on_a_full_disk, 2, args=(args, tmp_path / "shm"), timeout=300)
    line = "snapshot of step 3: rank 1 could not write its shard on node 1, so node 0's rank 0 wrote it there"
    assert said == [["", line], ["", line]], said
    assert sorted(snapshot.units(tmp_path / "shm" / "node0")["step_3/g1-node0"]) == [
        ".metadata", "__0_0.raw", "__1_0.raw", "config.toml", "manifest.json", "state.json"]
    assert snapshot.units(tmp_path / "shm" / "node1") == {}
    path = assemble_newest(tmp_path / "shm" / "node0", {}, KEY, -1, print)
    assert path == tmp_path / "shm" / "node0" / "checkpoints" / "step_3"

    torch.set_num_threads(1)
    single = base_args(corpus_dir, tmp_path / "load") + layout_args(1, 1, 1) + ["--train.steps", "4"]
    from_snapshot = Trainer(load_config(None, single + ["--train.resume", str(path)]))
    from_ckpt = Trainer(load_config(None, single + ["--train.resume", str(tmp_path / "run" / "checkpoints" / "step_3")]))
    want = dict(from_ckpt.model.named_parameters())
    for name, t in from_snapshot.model.named_parameters():
        torch.testing.assert_close(t, want[name], rtol=0, atol=0, msg=lambda s: f"{name}: {s}")
