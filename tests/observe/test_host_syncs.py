"""observe/host_syncs.py: the meter counts each read of a device value and each op sized by the data once, and
nothing that only the host computes from a value already read."""

import torch

from nanotitan.observe.host_syncs import HostSyncs


def test_each_device_read_counts_once_and_host_arithmetic_never():
    meter = HostSyncs(torch.device("cpu"))
    x = torch.randn(6, requires_grad=True)
    with meter:
        counts = (x > 0).long()
        host = counts.cpu()  # a read
        splits = host.tolist()  # the host's own copy: free from here on
        assert host.sum().item() == sum(splits)
        torch.tensor(splits).tolist()  # made from Python data: a host value
        torch.tensor(splits).to(x.device).tolist()  # put on the device, then read back: a read
        x[x > 0]  # boolean-mask indexing: sized by the data
        torch.repeat_interleave(torch.arange(6, device=x.device), counts)  # no output_size: sized by the data
        torch.repeat_interleave(torch.arange(6, device=x.device), counts, output_size=sum(splits))  # its size known
        counts.nonzero()
        bool(torch.isfinite(x.sum()))  # the finiteness verdict
        (x * 2).sum().backward()  # forward and backward of plain ops: none
    assert meter.reads == ["cpu", "tolist", "__getitem__", "repeat_interleave", "nonzero", "__bool__"]
    assert meter.count == 6


def test_a_cpu_read_of_a_cpu_tensor_leaves_the_tensor_a_device_value():
    """`.cpu()` of a CPU tensor returns the tensor itself: the host copy is tagged, not the device value."""
    meter = HostSyncs(torch.device("cpu"))
    counts = torch.arange(4, device="cpu")
    with meter:
        counts.cpu().tolist()
        counts.tolist()
    assert meter.count == 2
