"""Where an elastic job's snapshot units live, how long each is kept, and how node 0 puts a whole step together
(docs/elastic.md). A unit, `step_S/gG-nodeO` (snapshot.py), is written by node O's ranks on node O and pushed by
O's agent to the next member node: each unit is on two nodes, so losing one node loses none of a step.

Retention (`prune`, by each node's agent, for all of its node's snapshot dir): per origin node O, the units of O's
KEEP_PER_ORIGIN newest snapshots, and every unit of the newest snapshot that is complete across the job's nodes
(`complete_across`, from what each agent says it holds: `held/I`). Kept per origin, not by this node's own newest
steps: a peer whose pushes lag (a slow link, a paused agent) would otherwise have each replica removed as it
arrives, older than the receiver's own two newest, and the step its units complete is on no node.

Assembly (`assemble_newest`, on node 0 for a resume): the newest step whose every file is on node 0 or on a node
that answers, each file checked against the step's manifest.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..config.errors import first_line
from ..state.manifest import COMPLETE, MANIFEST, hash_file, unit_mismatch
from . import snapshot
from .transport import Peer, get_file, list_units

KEEP_PER_ORIGIN = 2  # snapshots kept of each origin node: its newest may be incomplete when a node dies


def _parse(rel: str) -> tuple[int, int, int]:
    m = snapshot.UNIT.fullmatch(rel)
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def held(root: Path) -> list[list[int]]:
    """[step, generation, origin node] of every committed unit on this node, sorted (what `held/I` says)."""
    return sorted(list(_parse(rel)) for rel in snapshot.units(root))


def complete_across(holdings: dict[int, list], members_of: dict[int, list[int]]) -> tuple[int, int] | None:
    """The newest (step, generation) of which every member node of that generation (`members_of[G]`) has a unit on
    some node (`holdings`: node -> its [step, generation, origin] list), or None."""
    origins: dict[tuple[int, int], set[int]] = {}
    for units in holdings.values():
        for step, gen, origin in units:
            origins.setdefault((step, gen), set()).add(origin)
    whole = [sg for sg, have in origins.items() if sg[1] in members_of and set(members_of[sg[1]]) <= have]
    return max(whole) if whole else None


def prune(root: Path, protected: tuple[int, int] | None = None) -> None:
    """Keep, per origin node, the units of its KEEP_PER_ORIGIN newest snapshots, and every unit of `protected`;
    remove the other units, and step dirs older than every kept unit (a write's leftovers in them too). A unit
    being written (.tmp) in a newer step is left alone."""
    by_origin: dict[int, list] = {}
    for rel in snapshot.units(root):
        step, gen, origin = _parse(rel)
        by_origin.setdefault(origin, []).append(((step, gen), rel))
    keep = {rel for units in by_origin.values() for _, rel in sorted(units)[-KEEP_PER_ORIGIN:]}
    keep |= {rel for units in by_origin.values() for sg, rel in units if sg == protected}
    for units in by_origin.values():
        for _, rel in units:
            if rel not in keep:
                shutil.rmtree(root / rel, ignore_errors=True)
    steps = sorted(_parse(rel)[0] for rel in keep)
    for d in root.glob("step_*"):
        s = d.name[5:]
        if not s.isdigit() or not steps or int(s) >= steps[-1]:  # a newer step may be being written
            continue
        if int(s) < steps[0]:
            shutil.rmtree(d, ignore_errors=True)  # older than every kept unit: a write's leftovers go too
        else:
            try:
                d.rmdir()  # empty: every unit in it went
            except OSError:
                pass


# --- coordinator side: the newest step whose files are all somewhere, assembled on node 0 -------------------

def assemble_newest(root: Path, peers: dict[int, Peer], key: bytes, newer_than: int, log) -> Path | None:
    """The newest snapshot step > newer_than whose every file is held by this node (ROOT) or a peer's FileServer
    (`peers`: node -> its transport.Peer, asked with the job's `key`; one that does not answer is skipped) and
    verifies: assembled into ROOT/checkpoints/step_N and returned. Each step passed over is named through `log`,
    with why."""
    holders: dict[tuple[int, int], dict[str, list]] = {}  # (step, gen) -> file -> [(addr or None, rel path)]

    def add(addr, inventory):
        for rel, files in inventory.items():
            step, gen, _ = _parse(rel)
            for name in files:
                holders.setdefault((step, gen), {}).setdefault(name, []).append((addr, f"{rel}/{name}"))

    add(None, snapshot.units(root))
    for node, addr in peers.items():
        try:
            add(addr, list_units(addr, key))
        except OSError as e:
            log(f"resume: node {node}'s snapshots are out of reach ({first_line(e)})")
    for step, gen in sorted(holders, reverse=True):
        if step <= newer_than:
            break
        files = holders[(step, gen)]
        where = f"snapshot step_{step} (generation {gen})"
        tmp = root / "checkpoints" / f"step_{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        why = _fetch(root, files, key, MANIFEST, tmp, None) or unit_mismatch(tmp)  # a garbled manifest is named
        if not why:
            manifest = json.loads((tmp / MANIFEST).read_bytes())["files"]
            missing = sorted(set(manifest) - set(files))
            if missing:
                why = f"{missing[0]} is on no node that answers"
            for name in sorted(manifest):
                why = why or _fetch(root, files, key, name, tmp, manifest[name])
        if why:
            log(f"resume: skipped {where}: {why}")
            shutil.rmtree(tmp, ignore_errors=True)
            continue
        (tmp / COMPLETE).write_text(f"step {step}\n")
        final = tmp.with_name(f"step_{step}")
        snapshot.commit(tmp, final)
        for d in final.parent.iterdir():  # the older assembled ones have served
            if d != final:
                shutil.rmtree(d, ignore_errors=True)
        return final
    return None


def _fetch(root: Path, files: dict[str, list], key: bytes, name: str, dest_dir: Path, want: dict | None) -> str:
    """Copy `name` from the first holder (this node's ROOT, or a peer's) whose copy matches `want` (size and
    xxh3); '' or why none did."""
    why = f"{name} is on no node that answers"
    for addr, rel in files.get(name, []):
        dest = dest_dir / name
        try:
            if addr is None:
                shutil.copyfile(root / rel, dest)
            else:
                get_file(addr, key, rel, dest)
        except OSError as e:
            why = f"{name} could not be read ({first_line(e)})"
            continue
        if want is None or hash_file(dest) == (want["bytes"], want["xxh3_64"]):
            return ""
        why = (f"{'shard' if name.endswith(('.distcp', '.raw')) else 'file'} {name} fails its checksum (xxh3_64) on "
               "every node that holds it")
    return why
