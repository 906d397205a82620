"""The config layer: the typed config (a leaf), its parsing and rules, the CLI's help text and the error classes.

    config.py     Config and its sections, load_config (TOML + dotted CLI overrides), validate, to_toml
    parse.py      TOML values and `--section.key VALUE` overrides as the fields' declared types
    errors.py     errors that end a run in one line, each kind with its exit code (ConfigError among them)
    layout.py     the experts' fold over EP x CP x TP (`expert_ranks`): the one rule dims, spec, rules and planner call
    tp_rules.py   tensor parallel's config rules: what TP splits must divide (validate calls it)
    cp_rules.py   context parallel's config rules: what CP splits must divide, and what it does not split yet
    placement_rules.py  expert placement's config rules (parallel.expert_placement, expert_replicas)
    controls_rules.py   the everyday controls' rules: the lr schedule, the data mixture, the export at the end
    run_rules.py  the rules of the keys that stand alone: training, data, the run dir
    elastic_rules.py  an elastic job's rules: its bounds, node 0's endpoint, the job id, the indexed loader
    changes.py    what differs between two configs (`key: old -> new`), for a resume to say
    packed_rules.py  document masks' and SFT's rules: what they compose with
    fp8_rules.py  FP8's rules: the recipe, the modules kept out of it, the dimensions its GEMMs take
    dispatch_rules.py  the EP dispatch's rules (parallel.ep_dispatch static, ep_capacity)
    fits.py       whether a job's model can fit at all, checked before anything is allocated
    counts.py     parameter and FLOP counts by formula, the one count fits.py and the planner both use
    hardware.py   hardware profiles: what one device computes, holds and moves per second
    hf_config.py  a transformers checkpoint's config.json as our model config (no torch)
    help.py       `nanotitan train --help`: every config key, its type, default and meaning

`from nanotitan.config import Config, load_config` keeps working; the package's modules import config.config."""

from .config import Config, ConfigError, load_config, to_toml, validate

__all__ = ["Config", "ConfigError", "load_config", "to_toml", "validate"]
