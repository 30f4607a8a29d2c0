"""A run directory keeps the settings its files were made from: ``tidal run`` on it with another model,
seed, task, data or warm-up is refused before anything is written, and ``--resume RUN_DIR key=value``
continues the saved run with the other settings changed."""

from pathlib import Path

import pytest

from tidal import cli
from tidal.cli import load_run_config
from tidal.configio import dump_config
from tidal.errors import ConfigError
from tidal.launcher import resume_source
from tidal.run_identity import check_run_dir


def _run_dir(tmp_path: Path, *held: str, overrides: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """A run directory as an earlier `tidal run` left it: its config.yaml and the files named in ``held``."""
    root = tmp_path / "run"
    root.mkdir()
    dump_config(load_run_config(None, [f"run_dir={root}", *overrides]), root / "config.yaml")
    for rel in held:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"")
    return root, root / "config.yaml"


def test_a_new_or_unchanged_run_dir_passes(tmp_path):
    check_run_dir(load_run_config(None, [f"run_dir={tmp_path / 'new'}"]), tmp_path / "new")
    root, _ = _run_dir(tmp_path, "init_hf/model.safetensors", "sft/hf/config.json", "journal/journal.log")
    check_run_dir(load_run_config(None, [f"run_dir={root}"]), root)


def test_a_changed_model_is_refused_once_the_initial_model_exists(tmp_path):
    root, _ = _run_dir(tmp_path)
    changed = load_run_config(None, [f"run_dir={root}", "model.hidden_size=64"])
    check_run_dir(changed, root)  # nothing made yet (an earlier launch stopped before): free to change
    (root / "init_hf").mkdir()
    (root / "init_hf" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError) as err:
        check_run_dir(changed, root)
    text = str(err.value)
    assert "model.hidden_size: 128 there, 64 given (its initial model" in text
    assert f"tidal run --resume {root}" in text and "another run_dir" in text


def test_each_file_binds_the_settings_it_was_made_from(tmp_path):
    root, _ = _run_dir(tmp_path, "journal/journal.log")
    for setting in ("task.num_train=4000", "seed=3", "broker.data.seed=5", "broker.data.shuffle=false"):
        with pytest.raises(ConfigError, match=r"its broker journal"):
            check_run_dir(load_run_config(None, [f"run_dir={root}", setting]), root)
    # the journal does not bind the warm-up or the model; epochs and reward workers change nothing made
    for setting in (
        "warmup.steps=9",
        "model.hidden_size=64",
        "broker.data.epochs=3",
        "task.reward_workers=2",
    ):
        check_run_dir(load_run_config(None, [f"run_dir={root}", setting]), root)
    (root / "sft" / "hf").mkdir(parents=True)
    (root / "sft" / "hf" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"warmup.steps: 400 there, 9 given \(its SFT checkpoint"):
        check_run_dir(load_run_config(None, [f"run_dir={root}", "warmup.steps=9"]), root)


def test_settings_that_made_nothing_may_change(tmp_path):
    root, _ = _run_dir(tmp_path, "init_hf/model.safetensors", "sft/hf/config.json", "journal/journal.log")
    changed = [
        f"run_dir={root}",
        "trainer.steps=900",
        "rollout.nodes=3",
        "broker.max_staleness=4",
        "broker.batch_groups=32",
        "trainer.optimizer.lr=3e-5",
    ]
    check_run_dir(load_run_config(None, changed), root)


def test_a_journal_elsewhere_binds_where_the_config_puts_it(tmp_path):
    journal = tmp_path / "journals" / "j1"
    root, _ = _run_dir(tmp_path, overrides=(f'broker.journal.dir="{journal}"',))
    config = load_run_config(None, [f"run_dir={root}", f'broker.journal.dir="{journal}"', "seed=2"])
    check_run_dir(config, root)
    journal.mkdir(parents=True)
    (journal / "journal.log").write_bytes(b"")
    with pytest.raises(ConfigError, match=rf"seed: 0 there, 2 given \(its broker journal {journal}\)"):
        check_run_dir(config, root)


def test_saved_settings_that_no_longer_load_are_named(tmp_path):
    root, saved = _run_dir(tmp_path)
    saved.write_text(saved.read_text() + "retired_setting: 1\n")
    with pytest.raises(
        ConfigError, match=rf"(?s)its saved settings {saved} no longer load .*retired_setting: unknown key"
    ):
        check_run_dir(load_run_config(None, [f"run_dir={root}"]), root)


def test_resume_loads_the_saved_settings_and_applies_the_command_lines_on_top(tmp_path):
    root, saved = _run_dir(tmp_path, overrides=("trainer.steps=7",))
    assert resume_source(None, ["trainer.steps=9"], ["--plain"]) == (None, ["trainer.steps=9"])
    path, overrides = resume_source(None, ["trainer.steps=9"], ["--resume", str(root), "--plain"])
    assert (path, overrides) == (str(saved), ["trainer.steps=9", f"run_dir={root}"])
    config = load_run_config(path, overrides)
    assert config.trainer.steps == 9 and config.run_dir == str(root)
    assert load_run_config(*resume_source(None, [], ["--resume", str(root)])).trainer.steps == 7


def test_resume_refuses_what_would_not_be_that_run(tmp_path):
    root, _ = _run_dir(tmp_path)
    with pytest.raises(ConfigError, match=r"give key=value settings to change, not other.yaml"):
        resume_source("other.yaml", [], ["--resume", str(root)])
    with pytest.raises(ConfigError, match=r"names the run directory; drop run_dir=/elsewhere"):
        resume_source(None, ["run_dir=/elsewhere"], ["--resume", str(root)])
    with pytest.raises(ConfigError, match=r"no .*nowhere/config.yaml \(not a tidal run directory\)"):
        resume_source(None, [], ["--resume", str(tmp_path / "nowhere")])
    with pytest.raises(ConfigError, match=r"--resume needs a run directory"):
        resume_source(None, [], ["--resume"])


def test_tidal_run_refuses_before_writing_anything(tmp_path, capsys):
    root, saved = _run_dir(tmp_path, "init_hf/model.safetensors")
    before = saved.read_text()
    assert cli.main(["run", f"run_dir={root}", "model.hidden_size=64", "--plain"]) == 2
    assert "model.hidden_size: 128 there, 64 given" in capsys.readouterr().err
    assert saved.read_text() == before  # the saved settings are not overwritten by the refused ones
    assert sorted(p.name for p in root.iterdir()) == ["config.yaml", "init_hf"]


def test_a_trainer_checkpoint_binds_the_model_and_the_warm_up_of_a_run_without_init_hf(tmp_path):
    # a run from model.path writes no init_hf/ and, without demonstrations, no SFT checkpoint
    root, _ = _run_dir(tmp_path, "train/checkpoints/latest")
    for setting in ("model.hidden_size=64", "warmup.enabled=true", "seed=3"):
        with pytest.raises(ConfigError, match=r"its trainer checkpoint"):
            check_run_dir(load_run_config(None, [f"run_dir={root}", setting]), root)
    check_run_dir(load_run_config(None, [f"run_dir={root}", "trainer.steps=900"]), root)
