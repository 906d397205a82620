"""Observer test helpers: the records of a W&B offline run file, read without wandb's reader."""

import json


def _wandb_records(path):
    """Records of a .wandb run file: W&B's header, then a LevelDB-style log of protobuf `Record`s (32 KiB
    blocks; chunks of 7-byte headers: crc, length, type 1 = full, 2 = first, 3 = middle, 4 = last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, buf, block = 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def _items(items) -> dict:
    return {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in items}
