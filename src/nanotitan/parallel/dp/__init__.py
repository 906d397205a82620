"""Data parallelism: the gradient-sync flavours, each behind one `GradSync` object (docs/dp.md).

    sync.py     the GradSync protocol and the replicated flavours (ReplicatedSync over the Reducer, TorchDDPSync),
                the gradient groups, the family-tag groups, and the checkpoint-form helpers (Pieces, flat_range_boxes)
    reducer.py  the bucketed gradient Reducer (the seed's DP) and the torch DDP baseline (wrap_ddp)
    zero.py     ZeRO-1/2: the Reducer's buckets reduce-scattered (ShardedReducer), ZeroSync over them
    fsdp.py     ZeRO-3 through torch FSDP2 (FSDPSync)
    fp8_gather.py  parallel.fp8_comm at ZeRO-3: FSDP2 all-gathers each FP8 weight as its forward GEMM's operand
"""
