"""--run.wandb true: the records of metrics.jsonl and the resolved config reach Weights & Biases (checked in
W&B's offline mode, by reading the run file it writes); a missing package or login is one line, not a
traceback, and the run goes on with metrics.jsonl."""

import json
import sys

import pytest

from nanotitan.config.config import ConfigError, load_config, to_dict
from nanotitan.observe.metrics import MetricsWriter
from tests.helpers.observe import _items, _wandb_records


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """W&B writes only under tmp_path and never reads the user's login."""
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "HOME"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    (tmp_path / "wandb_home").mkdir()
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("NETRC", raising=False)
    yield tmp_path / "wandb_home"
    import wandb

    wandb.teardown()  # stop W&B's service process now, not at interpreter exit


def test_records_and_config_reach_wandb_offline(tmp_path, wandb_env, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = load_config(None, ["--run.wandb", "true", "--run.dir", str(tmp_path / "run"), "--model.d_model", "48"])
    writer = MetricsWriter(cfg.run.dir, enabled=True, tensorboard=False, wandb_project=cfg.run.wandb_project,
                           config=to_dict(cfg))
    assert writer.wandb is not None
    for step in (1, 2, 3):
        writer.write({"step": step, "loss": 7.0 - step / 8, "lr": 1e-3 * step, "schedule": "1f1b",
                      "expert_load": [[step, 2], [3, 4]], "comm_ep_bytes": 1024 * step})
    writer.close()
    import wandb

    wandb.teardown()  # finish() can return before W&B's service has flushed the run file; the process exit would
    jsonl = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (run_file,) = (wandb_env / "wandb").glob("offline-run-*/run-*.wandb")
    records = list(_wandb_records(run_file))
    history = [_items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    assert len(history) == len(jsonl) == 3
    for logged, line in zip(history, jsonl):
        assert {k: logged[k] for k in line} == line  # every field, the same value (W&B adds _step, _runtime)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = _items(run.config.update)
    assert config["model"]["d_model"] == 48 and config["run"]["wandb"] is True and config == {
        **to_dict(cfg), **{k: v for k, v in config.items() if k.startswith("_")}}
    assert run.display_name == "run" and run.project == "nanotitan"


def test_missing_package_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'nanotitan\[wandb\]'"):
        load_config(None, ["--run.wandb", "true"])  # the launcher and every rank fail before any process group
    writer = MetricsWriter(str(tmp_path), enabled=True, tensorboard=False, wandb_project="nanotitan")
    writer.write({"step": 1, "loss": 1.0})
    writer.close()
    err = capsys.readouterr().err.strip()
    assert writer.wandb is None and "pip install 'nanotitan[wandb]'" in err and "\n" not in err
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 1.0


def test_no_login_is_one_line(tmp_path, wandb_env, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "online")
    writer = MetricsWriter(str(tmp_path), enabled=True, tensorboard=False, wandb_project="nanotitan")
    writer.write({"step": 1, "loss": 1.0})
    writer.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert writer.wandb is None and len(err) == 1 and "wandb login" in err[0], err
    assert (tmp_path / "metrics.jsonl").exists()
