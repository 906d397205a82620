"""Training state on disk: layout-independent checkpoints, verified before they are trusted.

    checkpoint.py  save and load through torch.distributed.checkpoint (DCP), any layout into any other
    keys.py        the global keys: this rank's pieces of every tensor, named independently of layout and zero level
    manifest.py    what is under RUN_DIR/checkpoints, its checksums, verification, and what to resume from
    metadata.py    reading a checkpoint's `.metadata` without running its bytes (no pickle)
    packing.py     the snapshot format: this rank's pieces packed into one host buffer, one raw file
    swap.py        a dir put in place of an older copy of itself (a re-save) without a moment with no whole copy
"""
