"""`nanotitan verify` (docs/verify.md): a config on a layout checked against one process, naming the first tensor that
diverges; the fuzzer over the composition space; Hugging Face conversions checked.

    check     the two configs, both runs, the outcome and its report (the command's body)
    world     one run on its ranks: the real Trainer, its first step captured
    capture   a rank's side: hooks on the built shard, every box in global coordinates
    compare   the judge: tensors and figures in execution order against their tolerances
    fuzz      `--fuzz N`: configurations drawn from the whole composition space, each verified, one table
    hf_check  `--hf DIR`: a Hugging Face checkpoint's import (and export) checked against transformers
    command   the command line: verify's own flags, then the config's
"""
