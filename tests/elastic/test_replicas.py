"""What each node keeps of the snapshot units (elastic/replicas.py): per origin node its 2 newest, never the newest
snapshot complete across the nodes. The old rule (each node's 2 newest steps) removed a lagging peer's copies as
they arrived, older than the receiver's own: with K = 5, one failure lost 160 steps ("__1_0.raw is on no node that
answers")."""

from nanotitan.elastic import replicas


def _units(root, *units):
    for step, gen, node in units:
        d = root / f"step_{step}" / f"g{gen}-node{node}"
        d.mkdir(parents=True)
        (d / "manifest.json").write_text("{}")


def _left(root):
    return sorted(tuple(map(int, (d.parent.name[5:], d.name[1:].split("-node")[0], d.name.split("-node")[1])))
                  for d in root.glob("step_*/g*-node*") if not d.name.endswith(".tmp"))


def test_a_lagging_origins_copies_are_kept_as_they_arrive(tmp_path):
    """Node 0's own units at 30, 35, 40; node 1's copies arriving 3 snapshots late (15, 20, 25)."""
    root = tmp_path / "node0"
    _units(root, (30, 2, 0), (35, 2, 0), (40, 2, 0), (15, 2, 1), (20, 2, 1), (25, 2, 1))
    (root / "step_10" / "g2-node0.tmp").mkdir(parents=True)  # a write a kill cut short, older than anything kept
    (root / "step_45" / "g2-node0.tmp").mkdir(parents=True)  # the rank writing its next unit now
    replicas.prune(root)
    assert _left(root) == [(20, 2, 1), (25, 2, 1), (35, 2, 0), (40, 2, 0)]
    assert not (root / "step_10").exists() and (root / "step_45" / "g2-node0.tmp").is_dir()
    assert not (root / "step_15").exists() and not (root / "step_30").exists()


def test_the_newest_step_complete_across_nodes_is_never_pruned(tmp_path):
    """Node 1's snapshots of steps 35 and 40 failed (a full disk): 30 is the newest step every member has a unit of.
    Node 0 keeps its own unit of 30 although it is not among its two newest."""
    held = {0: [[30, 2, 0], [35, 2, 0], [40, 2, 0], [30, 2, 1]], 1: [[25, 2, 1], [30, 2, 1], [30, 2, 0]]}
    assert replicas.complete_across(held, {2: [0, 1]}) == (30, 2)
    assert replicas.complete_across(held, {2: [0, 1, 2]}) is None  # node 2's units are nowhere
    assert replicas.complete_across(held, {}) is None  # a generation whose members this node never read
    root = tmp_path / "node0"
    _units(root, *map(tuple, held[0]))
    replicas.prune(root, protected=(30, 2))
    assert _left(root) == [(30, 2, 0), (30, 2, 1), (35, 2, 0), (40, 2, 0)]
    replicas.prune(root)  # without the protection, node 0's own 30 goes
    assert _left(root) == [(30, 2, 1), (35, 2, 0), (40, 2, 0)]
