"""train.resume's default made concrete (run/rundir.py settle_resume): the same command run again continues its run
dir's checkpoints, another config's are refused with the three ways out, never and run.overwrite start fresh."""

import pytest

from nanotitan.config.config import load_config, to_toml
from nanotitan.run import rundir


def _checkpoint(run_dir, step, config_toml):
    d = run_dir / "checkpoints" / f"step_{step}"
    d.mkdir(parents=True)
    (d / "COMPLETE").write_text(f"step {step}\n")
    if config_toml is not None:
        (d / "config.toml").write_text(config_toml)


def test_the_same_command_resumes_and_another_config_is_refused(tmp_path):
    cfg = load_config(None, ["--train.steps", "40", "--run.dir", str(tmp_path)])
    mine = to_toml(cfg)
    assert rundir.settle_resume(tmp_path, "", False, mine) == ("never", "")  # nothing to continue
    _checkpoint(tmp_path, 10, mine)
    _checkpoint(tmp_path, 20, mine)
    value, line = rundir.settle_resume(tmp_path, "", False, mine)
    assert value == "auto" and line == (f"run dir {tmp_path} holds this config's checkpoints (step_10..step_20): "
                                        "continuing from the newest (--train.resume never --run.overwrite true "
                                        "starts over)")
    # what says how to treat the dir is no change of config
    again = load_config(None, ["--train.steps", "40", "--run.dir", str(tmp_path), "--train.allow_data_change", "true"])
    assert rundir.settle_resume(tmp_path, "", False, to_toml(again))[0] == "auto"
    other = to_toml(load_config(None, ["--train.steps", "80", "--model.d_model", "64", "--run.dir", str(tmp_path)]))
    with pytest.raises(rundir.RunDirError) as e:
        rundir.settle_resume(tmp_path, "", False, other)
    assert str(e.value) == (f"run dir {tmp_path} holds checkpoints of an earlier run (step_10..step_20, another "
                            "config: model.d_model: 128 -> 64; train.steps: 40 -> 80) and this is a fresh run: "
                            "continue it with --train.resume auto, delete them with --run.overwrite true, or choose "
                            "another --run.dir")
    assert rundir.settle_resume(tmp_path, "", True, other) == ("never", "")  # overwrite: check_fresh deletes them
    assert rundir.settle_resume(tmp_path, "auto", False, other) == ("auto", "")  # explicit: as asked
    assert rundir.settle_resume(tmp_path, "never", False, mine) == ("never", "")
    with pytest.raises(rundir.RunDirError, match="and this is a fresh run: continue it with --train.resume auto"):
        rundir.check_fresh(tmp_path, "never", False)  # never over checkpoints needs run.overwrite
    assert rundir.check_fresh(tmp_path, "auto", False) == ""


def test_checkpoints_without_a_readable_config_are_another_runs(tmp_path):
    _checkpoint(tmp_path, 4, None)
    with pytest.raises(rundir.RunDirError, match=r"\(step_4, its step_4/config\.toml is unreadable\) and this is a "
                                                 r"fresh run: continue it with --train\.resume auto, delete them"):
        rundir.settle_resume(tmp_path, "", False, to_toml(load_config(None, [])))


def test_a_restarted_attempt_continues_the_jobs_own_checkpoints(tmp_path, monkeypatch):
    """Under train.max_restarts torchrun restarts every rank with the same command: the default then resumes, even
    where run.overwrite deleted an earlier run's checkpoints at the first attempt."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert rundir.settle_resume(tmp_path, "", True, "") == ("auto", "")
    assert rundir.settle_resume(tmp_path, "never", False, "") == ("never", "")
