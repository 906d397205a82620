"""Pipeline parallelism: one home.

    facts.py      what every schedule is, in numbers: warm-up, in-flight microbatches, the lanes' orders, the
                  theoretical bubble (the schedules, the planner and the tests all ask these, never a copy)
    schedules.py  GPipe, 1F1B, interleaved (V chunks) and zb1 over a stage's microbatches (StepStats), and the
                  forward-only pass of evaluation; the shard's EP lanes come in as a `Lanes` argument
    runner.py     one microbatch's F / B / W on a chunk, a type per way a backward runs: StageRunner (plain
                  autograd), FillRunner (the lanes' fill), SplitRunner (zb1's B/W split)
    comms.py      a stage's P2P endpoints (StageComms) with their reusable receive buffers
    chunks.py     a rank's V model chunks joined as one stage (StageChunks), global names kept

The EP lanes (two microbatch lanes overlapping EP's all-to-alls) live beside this package, in parallel/lanes.py.
Nothing is re-exported here: importers name the module they read (`from nanotitan.parallel.pp.facts import
in_flight`), so this package imports nothing and no import cycle can close through it.
"""
