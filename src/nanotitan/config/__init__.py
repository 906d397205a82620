"""The config layer: the typed config (a leaf), its one resolve step, the CLI's help text and the error classes.

`from nanotitan.config import Config, load_config` keeps working; the package's modules import config.config."""

from .config import Config, ConfigError, load_config, to_toml, validate

__all__ = ["Config", "ConfigError", "load_config", "to_toml", "validate"]
