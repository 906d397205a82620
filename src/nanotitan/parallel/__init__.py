"""Parallelism: how one rank's shard is built, synchronised and stepped, for any DP x PP x EP x TP x CP layout.

    dims.py         ParallelDims: a rank's (dp, pp, ep, cp, tp) coordinates, its neighbours and process groups
                    (docs/design.md §3)
    parallelize.py  this rank's trainable shard: shard spec -> Transformer -> EP -> broadcasts -> gradient sync
    build.py        a rank's stage chunks, built without ever holding the whole stage
    init.py         start-of-training agreement between replicas: broadcast parameters, check they agree
    step.py         one training step's mechanics on one rank
    clip.py         global-norm gradient clipping across the axes, each parameter counted once
    ep.py           expert parallelism: each token's top-k assignments to their experts' ranks and back
    placement.py    which expert each slot of each EP rank holds (EPShard: a layer's table, identity when static), the
                    routes by it, and the balanced placement's rule
    rebalance.py    a balanced placement at run time: its window and moves (Rebalancer), its copies' gradient (CopyFold)
    lanes.py        parallel.ep_overlap_microbatches: two lanes, a forward beside a backward, hiding EP's all-to-alls
    tp.py           tensor parallel with sequence parallel: Megatron's split of a stage's dense part
    cp.py           context parallel: each sequence cut into 2N chunks, CP rank i holding i and 2N-1-i (CPShard)
    cp_attn.py      attention under CP: the ring, all-to-all (Ulysses) and MLA-latent ring
    cp_split.py     which chunks each CP rank holds: zigzag, or balanced over a microbatch's documents (CPLayout)
    shard.py        each parameter's gradient layout over the ranks (grad_layout: ALONE, WHOLE, SHARDED, PARTIAL)
    tied.py         the token embedding shared by the first and the last pipeline stage (MTP)
    where.py        where each element of a global tensor lives on any rank (DP shard, TP slice, expert slots)
    compile.py      train.compile: torch.compile each transformer block in place
    dp/             data parallelism: the gradient-sync flavours (GradSync), the Reducer, ZeRO-1/2, ZeRO-3 (FSDP2)
    comm/           every collective and P2P (calls, bytes, waits per axis), the stall record, the network emulator
    pp/             pipeline parallelism: the schedules, their facts, a stage's P2P endpoints and chunks
"""
