"""What a run tells its user and what it measures of itself.

    report.py     the per-step record, MoE load statistics, the end-of-run summary and progress, and the observers
                  a rank opens for them (writer, profiler, memory meters)
    metrics.py    throughput, MFU and the per-step record's outputs: console, metrics.jsonl, TensorBoard
    console.py    what a rank's console shows while training: a plain line per record, or the progress bar
    host_syncs.py the step's host reads of device values (`host_syncs` in metrics.jsonl), by site
    memory.py     the bytes of live tensors per layout (not the process's RSS), and the meters that count them
    profiling.py  `--run.profile_steps A-B`: torch.profiler traces of those steps on every rank, a table per rank
    plot.py       `nanotitan plot RUN_DIR ...`: pictures of runs from their metrics.jsonl
    runs.py       a finished run read back (its records, summary and tensor bytes), and a layout's CLI arguments
    dp_modes.py   the DP flavours' bytes and times, one zero mode per process (`nanotitan bench dp --zero`'s worker)
"""
