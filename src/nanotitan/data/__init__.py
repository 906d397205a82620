"""Data: where text comes from, its tokenizer, and the loaders that hand each data rank its batches.

    sources.py    the Shakespeare corpus (default), an HF hub dataset, or local files
    tokenizer.py  byte-level BPE: trained on the corpus with HF `tokenizers`, or loaded from a tokenizer.json
    prepare.py    tokenize data.source once into a cached directory of flat token files
    sft.py        data.format=sft: .jsonl prompt/response records packed whole, with a loss mask on the responses
    chat.py       SFT's `messages` records: rendered with the tokenizer's chat template, the assistant turns learned
    indexed.py    the default loader: data by global index (docs/design.md §4)
    mix.py        data.mix: batches that blend prepared sources by weight, exactly, a pure function of (seed, step)
    streaming.py  the streaming loader (the first loader, kept): stream, shuffle, split by data rank, tokenize, pack
"""
