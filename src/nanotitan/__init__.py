"""nanoTitan: readable MoE training over DP, PP, EP, TP and CP (docs/architecture.md maps the floors).

    config/      the typed config (a leaf), its parsing and rules, help, errors, hardware profiles
    model/       the decoder-only MoE transformer, built whole or as one rank's shard
    data/        sources, tokenizer, prepared token files and the loaders
    parallel/    how one rank's shard is built, synchronised and stepped on any layout
    state/       checkpoints: global keys, manifests, verification, the snapshot format
    optim/       the optimizers: AdamW, Muon, QK-clip
    interop/     Hugging Face import and export
    run/         launching ranks, the run dir, a rank's setup
    observe/     metrics, memory meters, the record and summary, plots, profiling
    plan/        the layout planner (`nanotitan plan`)
    elastic/     elastic jobs: nodes join and leave, the layout follows
    verify/      `nanotitan verify`: a layout checked against one process
    bench/       the `nanotitan bench` benchmarks
    resolve.py   the one step that makes every "auto" of the config concrete
    train.py     the Trainer: init, train_step, the loop
    evaluate.py  `nanotitan eval`: loss and perplexity of a checkpoint on a held-out set
    generate.py  `nanotitan generate`: KV-cached sampling from a run or an HF checkpoint
    hf.py        `nanotitan.hf.load_pretrained` / `save_pretrained`, the public names
    cli.py       the `nanotitan` command
"""
