"""Typed configuration: defaults < TOML file < command-line flags, errors as argparse errors, and the real
configs of the two scripts."""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

import sdxl_trainer.config
from sdxl_trainer.config import config_to_dict, option, parse_config, write_resolved_config

# --- helpers ----------------------------------------------------------------------------------------------


@dataclass
class ExampleConfig:
    data_dir: Path = option(help="input folder")
    steps: int = option(10, help="number of steps")
    learning_rate: float = option(0.5, help="step size")
    shuffle: bool = option(True, help="shuffle the data")
    mode: Literal["fast", "slow"] = option("fast", help="how to run")
    extra_dirs: list[Path] = option([Path("x")], help="more folders")
    thresholds: list[float] | None = option(None, help="numbers")
    seed: int | None = option(None, help="seed; None = random")

    def validate(self) -> list[str]:
        problems = []
        if self.steps < 1:
            problems.append(f"--steps must be at least 1, got {self.steps}")
        if self.learning_rate > 1:
            problems.append("--learning_rate is too large")
        return problems


def parse(argv: list[str]) -> ExampleConfig:
    return parse_config(ExampleConfig, argv)


def toml_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text, encoding="utf-8")
    return path


def parse_error(capsys, argv: list[str]) -> str:
    """Parse expecting an argparse error; returns its stderr."""
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


# --- parse_config -----------------------------------------------------------------------------------------


def test_defaults():
    config = parse(["--data_dir", "data"])
    assert config == ExampleConfig(data_dir=Path("data"), steps=10, learning_rate=0.5, shuffle=True, mode="fast", extra_dirs=[Path("x")], seed=None)
    assert isinstance(config.data_dir, Path)


def test_list_default_is_not_shared():
    first, second = parse(["--data_dir", "a"]), parse(["--data_dir", "b"])
    first.extra_dirs.append(Path("y"))
    assert second.extra_dirs == [Path("x")]


def test_cli_overrides():
    config = parse(
        ["--data_dir", "d", "--steps", "3", "--learning_rate", "0.25", "--no-shuffle", "--mode", "slow", "--extra_dirs", "a", "b", "--seed", "7"]
    )
    assert config.steps == 3 and config.learning_rate == 0.25
    assert config.shuffle is False
    assert config.mode == "slow"
    assert config.extra_dirs == [Path("a"), Path("b")]
    assert config.seed == 7


def test_bool_flag_both_ways():
    assert parse(["--data_dir", "d", "--shuffle"]).shuffle is True
    assert parse(["--data_dir", "d", "--no-shuffle"]).shuffle is False


def test_toml_values(tmp_path):
    path = toml_file(
        tmp_path,
        'data_dir = "from_toml"\nsteps = 4\nlearning_rate = 0.125\nshuffle = false\nmode = "slow"\nextra_dirs = ["p", "q"]\nseed = 3\n',
    )
    config = parse(["--config", str(path)])
    assert config == ExampleConfig(
        data_dir=Path("from_toml"), steps=4, learning_rate=0.125, shuffle=False, mode="slow", extra_dirs=[Path("p"), Path("q")], seed=3
    )
    assert isinstance(config.data_dir, Path) and all(isinstance(p, Path) for p in config.extra_dirs)


def test_cli_overrides_toml(tmp_path):
    path = toml_file(tmp_path, 'data_dir = "from_toml"\nsteps = 4\nshuffle = false\n')
    config = parse(["--config", str(path), "--steps", "9", "--shuffle"])
    assert config.data_dir == Path("from_toml")  # from the file
    assert config.steps == 9 and config.shuffle is True  # from the flags
    assert config.learning_rate == 0.5  # default


def test_int_in_toml_for_float_field_becomes_float(tmp_path):
    config = parse(["--config", str(toml_file(tmp_path, 'data_dir = "d"\nlearning_rate = 1\n'))])
    assert config.learning_rate == 1.0 and isinstance(config.learning_rate, float)


def test_ints_in_a_toml_list_of_floats_become_floats(tmp_path, capsys):
    config = parse(["--config", str(toml_file(tmp_path, 'data_dir = "d"\nthresholds = [3200, 6.5]\n'))])
    assert config.thresholds == [3200.0, 6.5] and all(isinstance(value, float) for value in config.thresholds)
    err = parse_error(capsys, ["--config", str(toml_file(tmp_path, 'data_dir = "d"\nthresholds = [1, "high", true]\n'))])
    assert "thresholds items must be of type number, got ['high', True]" in err


def test_unknown_toml_key(tmp_path, capsys):
    err = parse_error(capsys, ["--config", str(toml_file(tmp_path, 'data_dir = "d"\nlerning_rate = 0.1\n'))])
    assert "unknown keys ['lerning_rate']" in err


def test_missing_required(capsys):
    err = parse_error(capsys, ["--steps", "3"])
    assert "missing required options: --data_dir" in err


def test_a_flag_given_twice_with_another_value_is_warned_about_and_the_last_value_taken(capsys):
    """Last wins, as argparse users expect (a launch script's flags followed by "$@" are overridden that way),
    but never silently: the warning names the flag and both values."""
    config = parse(["--data_dir", "d", "--steps", "3", "--shuffle", "--extra_dirs", "a", "--steps", "5", "--no-shuffle", "--extra_dirs", "a", "b"])
    assert config.steps == 5 and config.shuffle is False and config.extra_dirs == [Path("a"), Path("b")]
    assert capsys.readouterr().err.splitlines() == [
        "warning: --steps is given twice (3, then 5): using the last, 5",
        "warning: --shuffle is given twice (--shuffle, then --no-shuffle): using the last, --no-shuffle",
        "warning: --extra_dirs is given twice (a, then a b): using the last, a b",
    ]
    assert parse(["--data_dir", "d", "--steps", "3", "--steps", "3"]).steps == 3  # the same value twice: nothing to choose between
    assert capsys.readouterr().err == ""


def test_a_path_flag_refuses_a_url_instead_of_making_a_local_folder_of_it(tmp_path, capsys, monkeypatch):
    """Path("s3://bucket/x") is the local path s3:/bucket/x: a flag that takes a file or folder refuses a URL,
    from the command line and from a TOML file, naming the flag; the trainer's --output_dir says what to do."""
    from sdxl_trainer.jobs.train_config import TrainConfig

    monkeypatch.chdir(tmp_path)
    err = parse_error(capsys, ["--data_dir", "s3://bucket/data"])
    assert err.endswith("error: argument --data_dir: s3://bucket/data is a URL: this flag takes a local path\n")
    err = parse_error(capsys, ["--data_dir", "d", "--extra_dirs", "a", "gs://bucket/b"])
    assert err.endswith("error: argument --extra_dirs: gs://bucket/b is a URL: this flag takes a local path\n")
    err = parse_error(capsys, ["--config", str(toml_file(tmp_path, 'data_dir = "s3://bucket/data"\n'))])
    assert err.endswith("data_dir = 's3://bucket/data' is a URL: this flag takes a local path\n")
    with pytest.raises(SystemExit) as refused:
        parse_config(TrainConfig, ["--cached_dataset_dirs", "c", "--output_dir", "s3://bucket/runs"])
    assert refused.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].endswith(
        "error: argument --output_dir: s3://bucket/runs: run folders in object storage are not supported yet (checkpoints, exports and "
        "logs are written as files); give a local --output_dir and copy the run folder to the bucket (aws s3 sync, rclone; docs/object_storage.md)"
    )
    assert list(tmp_path.iterdir()) == [tmp_path / "config.toml"]  # no s3: folder
    with pytest.raises(SystemExit):
        parse_config(TrainConfig, ["--cached_dataset_dirs", "c", "--load_saved_state", "s3://bucket/runs/run/checkpoints/update_00000010"])
    assert (
        "--load_saved_state s3://bucket/runs/run/checkpoints/update_00000010: checkpoints in object storage are not read; copy the "
        "run folder to a local one (aws s3 sync, rclone) and resume from there (docs/object_storage.md)"
    ) in capsys.readouterr().err


def test_required_given_by_toml_only(tmp_path):
    assert parse(["--config", str(toml_file(tmp_path, 'data_dir = "d"\n'))]).data_dir == Path("d")


def test_bad_choice_on_cli(capsys):
    err = parse_error(capsys, ["--data_dir", "d", "--mode", "medium"])
    assert "--mode" in err and "medium" in err


def test_bad_choice_in_toml(tmp_path, capsys):
    err = parse_error(capsys, ["--config", str(toml_file(tmp_path, 'data_dir = "d"\nmode = "medium"\n'))])
    assert "mode = 'medium' is not one of ('fast', 'slow')" in err


@pytest.mark.parametrize(
    "line,expected",
    [
        ('steps = "ten"', "steps = 'ten' should be of type int"),
        ("steps = 1.5", "steps = 1.5 should be of type int"),
        ("steps = true", "steps = True should be of type int"),
        ("shuffle = 1", "shuffle = 1 should be of type bool"),
        ('learning_rate = "fast"', "learning_rate = 'fast' should be of type float"),
        ("data_dir = 5", "data_dir = 5 should be of type Path"),
        ('extra_dirs = "p"', "extra_dirs must be a list"),
    ],
)
def test_toml_type_mismatch(tmp_path, capsys, line, expected):
    text = line + "\n" if line.startswith("data_dir") else f'data_dir = "d"\n{line}\n'
    err = parse_error(capsys, ["--config", str(toml_file(tmp_path, text))])
    assert expected in err


def test_toml_list_with_wrong_item_type_is_an_argparse_error(tmp_path, capsys):
    err = parse_error(capsys, ["--config", str(toml_file(tmp_path, 'data_dir = "d"\nextra_dirs = [1, 2]\n'))])
    assert "extra_dirs" in err


def test_bad_int_on_cli(capsys):
    err = parse_error(capsys, ["--data_dir", "d", "--steps", "many"])
    assert "--steps" in err


def test_validate_problems_are_reported(capsys):
    err = parse_error(capsys, ["--data_dir", "d", "--steps", "0", "--learning_rate", "2"])
    assert "invalid configuration" in err
    assert "--steps must be at least 1, got 0" in err
    assert "--learning_rate is too large" in err


def test_help_lists_defaults_and_required(capsys):
    with pytest.raises(SystemExit) as info:
        parse(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--data_dir" in out and "(required)" in out
    assert "(default: 10)" in out and "--no-shuffle" in out


# --- writing the resolved config --------------------------------------------------------------------------


def test_write_resolved_config(tmp_path):
    config = parse(["--data_dir", "some/data", "--extra_dirs", "a", "b/c"])
    path = tmp_path / "run" / "nested" / "config.json"
    write_resolved_config(config, path)
    saved = json.loads(path.read_text(encoding="utf-8"))
    assert saved == {
        "data_dir": "some/data",
        "steps": 10,
        "learning_rate": 0.5,
        "shuffle": True,
        "mode": "fast",
        "extra_dirs": ["a", "b/c"],
        "thresholds": None,
        "seed": None,
    }
    assert list(saved) == sorted(saved)
    assert config_to_dict(config) == saved


def test_resolved_config_can_be_read_back_as_toml_values(tmp_path):
    # What was written describes the run completely: feeding its values back gives the same config.
    config = parse(["--data_dir", "d", "--steps", "3", "--mode", "slow", "--seed", "5"])
    values = config_to_dict(config)
    lines = [f"{key} = {json.dumps(value)}" for key, value in values.items() if value is not None]
    assert parse(["--config", str(toml_file(tmp_path, "\n".join(lines) + "\n"))]) == config


# --- the real configs -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def train_config_class():
    from sdxl_trainer.jobs.train_config import TrainConfig

    return TrainConfig


@pytest.fixture(scope="module")
def cache_config_class():
    from sdxl_trainer.jobs.cache_config import CacheConfig

    return CacheConfig


@pytest.mark.parametrize(
    "config_fixture,expected_flags",
    [
        ("train_config_class", ("--cached_dataset_dirs", "--conditional_dropout_percent")),
        ("cache_config_class", ("--data_dir", "--cache_dir")),
    ],
)
def test_script_config_help(config_fixture, expected_flags, request, capsys):
    with pytest.raises(SystemExit) as info:
        parse_config(request.getfixturevalue(config_fixture), ["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert all(flag in out for flag in expected_flags)


@pytest.mark.parametrize("config_fixture", ["train_config_class", "cache_config_class"])
def test_every_option_of_both_scripts_is_documented(config_fixture, request):
    """The flag reference, docs/flags.md, is generated from each option's help text (tests/docs/test_flag_reference.py
    keeps it current) and README points to it: an option without a real help text would be undocumented."""
    import dataclasses

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    fields = dataclasses.fields(request.getfixturevalue(config_fixture))
    undocumented = [field.name for field in fields if len(field.metadata.get("help", "").split()) < 3]
    assert undocumented == [], f"options without a help text: {undocumented}"
    assert "(docs/flags.md)" in readme


def test_train_config_defaults(train_config_class):
    config = parse_config(train_config_class, ["--cached_dataset_dirs", "c1", "c2"])
    assert config.cached_dataset_dirs == ["c1", "c2"]
    assert config.conditional_dropout_percent == 0.1
    assert (config.min_resolution, config.max_resolution, config.pretrained_model_name_or_path) == (None, None, None)  # the caches'


# --- the trainer takes what its caches record -------------------------------------------------------------


def cache_info_copy(cache_dir: Path, destination: Path, **changes) -> Path:
    """A folder holding `cache_dir`'s cache_info.json with `changes` and its empty prompt (all the trainer's cache
    check reads; without manifest parts, no checksum of the empty prompt is recorded)."""
    info = json.loads((cache_dir / "cache_info.json").read_text())
    destination.mkdir()
    (destination / "cache_info.json").write_text(json.dumps({**info, **changes}))
    shutil.copy(cache_dir / "empty_prompt.safetensors", destination)
    return destination


def test_the_trainer_takes_the_model_and_resolution_range_from_its_cache(train_config_class, sample_cache_dir, tiny_pipeline_dir):
    from sdxl_trainer.jobs.train_config import with_cache_settings

    parsed = parse_config(train_config_class, ["--cached_dataset_dirs", str(sample_cache_dir)])
    config, caches = with_cache_settings(parsed)
    assert caches.problems == []
    assert (config.min_resolution, config.max_resolution) == (256, 320)  # what the conftest cache was made with
    assert config.pretrained_model_name_or_path == str(tiny_pipeline_dir)
    assert (parsed.min_resolution, parsed.max_resolution, parsed.pretrained_model_name_or_path) == (None, None, None)  # parsed stays as parsed


def test_a_resolution_flag_that_contradicts_the_cache_is_refused_naming_the_cache_and_the_fix(train_config_class, sample_cache_dir):
    from sdxl_trainer.jobs.train_config import with_cache_settings

    agreeing = parse_config(train_config_class, ["--cached_dataset_dirs", str(sample_cache_dir), "--min_resolution", "256", "--max_resolution", "320"])
    assert with_cache_settings(agreeing)[1].problems == []
    config = parse_config(train_config_class, ["--cached_dataset_dirs", str(sample_cache_dir), "--min_resolution", "512"])
    assert with_cache_settings(config)[1].problems == [
        f"--min_resolution 512 does not match the caches: {sample_cache_dir} was made with --min_resolution 256; drop the flag "
        "(the trainer takes the range from the caches) or re-cache with --min_resolution 512"
    ]


def test_caches_of_different_ranges_train_together_over_both(train_config_class, sample_cache_dir, tmp_path):
    from sdxl_trainer.jobs.train_config import with_cache_settings

    larger = cache_info_copy(sample_cache_dir, tmp_path / "larger", min_resolution=320, max_resolution=768)
    config, caches = with_cache_settings(parse_config(train_config_class, ["--cached_dataset_dirs", str(sample_cache_dir), str(larger)]))
    assert caches.problems == []
    assert (config.min_resolution, config.max_resolution) == (256, 768)


def test_caches_that_name_their_model_differently_need_the_model_flag(train_config_class, sample_cache_dir, tiny_pipeline_dir, tmp_path):
    from sdxl_trainer.jobs.train_config import with_cache_settings

    old_place = str(tmp_path / "old_place" / "tiny_sdxl")  # the model's own VAE is recorded under the model's name too
    moved = cache_info_copy(sample_cache_dir, tmp_path / "moved", pretrained_model_name_or_path=old_place, vae_name_or_path=old_place)
    config = parse_config(train_config_class, ["--cached_dataset_dirs", str(moved)])
    (problem,) = with_cache_settings(config)[1].problems
    assert f"the caches' model (as their cache_info.json names it; pass --pretrained_model_name_or_path where it moved) {old_place} does not exist" in problem
    both = parse_config(train_config_class, ["--cached_dataset_dirs", str(sample_cache_dir), str(moved)])
    (problem,) = with_cache_settings(both)[1].problems
    assert problem.startswith("the caches were made from models named") and problem.endswith("name the one to train with --pretrained_model_name_or_path")
    named = parse_config(train_config_class, ["--cached_dataset_dirs", str(sample_cache_dir), str(moved), "--pretrained_model_name_or_path", str(tiny_pipeline_dir)])
    assert with_cache_settings(named)[1].problems == []  # the same model family (by fingerprint), wherever it lives now


def test_train_config_rejects_dropout_percent_as_percent(train_config_class, capsys):
    with pytest.raises(SystemExit) as info:
        parse_config(train_config_class, ["--cached_dataset_dirs", "c", "--conditional_dropout_percent", "10"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--conditional_dropout_percent is a share between 0 and 1" in err
    assert "got 10.0" in err


def test_train_config_rejects_bad_resolution(train_config_class, capsys):
    with pytest.raises(SystemExit):
        parse_config(train_config_class, ["--cached_dataset_dirs", "c", "--max_resolution", "1000"])
    assert "--max_resolution=1000" in capsys.readouterr().err


def test_cache_config_checks_folders(cache_config_class, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    config = parse_config(cache_config_class, ["--data_dir", str(data), "--cache_dir", str(tmp_path / "cache")])
    assert config.data_dir == str(data) and config.min_resolution == 512
    with pytest.raises(SystemExit):
        parse_config(cache_config_class, ["--data_dir", str(data), "--cache_dir", str(data / "cache")])
    assert "is inside --data_dir" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(cache_config_class, ["--data_dir", str(tmp_path / "missing"), "--cache_dir", str(tmp_path / "cache")])
    assert "is not a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(cache_config_class, ["--data_dir", "s3://bucket/images", "--cache_dir", str(tmp_path / "cache")])
    assert "--data_dir s3://bucket/images: object storage is read as tar shards only (--tar_shards)" in capsys.readouterr().err

def test_a_cache_in_object_storage_under_the_tar_prefix_is_refused(cache_config_class, capsys):
    with pytest.raises(SystemExit):
        parse_config(cache_config_class, ["--data_dir", "s3://bucket/tars", "--tar_shards", "--cache_dir", "s3://bucket/tars/cache"])
    assert "--cache_dir s3://bucket/tars/cache is inside --data_dir s3://bucket/tars" in capsys.readouterr().err


def test_the_run_folder_and_the_caches_and_model_it_reads_never_overlap(train_config_class, tmp_path, capsys):
    """The trainer writes checkpoints and exports into OUTPUT_DIR/PROJECT_NAME (and --overwrite_run clears it):
    a cache or the model it trains from inside it, or the run folder inside a cache, is refused."""
    run_dir = tmp_path / "out" / "run"
    run = ["--output_dir", str(tmp_path / "out"), "--project_name", "run"]
    (run_dir / "pipeline").mkdir(parents=True)  # an earlier run's export
    cases = [
        (["--cached_dataset_dirs", str(run_dir)], f"cache {run_dir} is the run folder"),
        (["--cached_dataset_dirs", str(run_dir / "cache")], f"cache {run_dir / 'cache'} is inside the run folder {run_dir}"),
        (["--cached_dataset_dirs", str(tmp_path / "out")], f"the run folder {run_dir} is inside cache {tmp_path / 'out'}"),
        (["--cached_dataset_dirs", str(tmp_path / "cache"), "--pretrained_model_name_or_path", str(run_dir / "pipeline")],
         f"--pretrained_model_name_or_path {run_dir / 'pipeline'} is inside the run folder {run_dir}"),
    ]
    for flags, message in cases:
        with pytest.raises(SystemExit):
            parse_config(train_config_class, [*run, *flags])
        assert message in capsys.readouterr().err, flags
    parse_config(train_config_class, [*run, "--cached_dataset_dirs", str(tmp_path / "cache"), "--pretrained_model_name_or_path", str(tmp_path / "out" / "other" / "pipeline")])



@pytest.mark.parametrize("config_file", sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml")), ids=lambda path: path.stem)
def test_example_configs_parse_and_validate(config_file, train_config_class):
    config = parse_config(train_config_class, ["--config", str(config_file)])
    assert config.mixed_precision == "bf16" and config.optimizer == "adamw8bit" and config.gradient_checkpointing
    assert config.train_batch_size >= 1 and config.cached_dataset_dirs


def test_there_is_an_example_config_per_common_machine():
    names = {path.stem for path in (Path(__file__).resolve().parents[2] / "configs").glob("*.toml")}
    assert {"2x24gb_consumer", "8x80gb_datacenter", "multinode_4x8x80gb"} <= names


@pytest.mark.multiprocess
def test_a_run_without_a_seed_records_the_one_it_drew(tmp_path, sample_cache_dir, tiny_pipeline_dir):
    """The drawn seed reaches config.json (to repeat the run) and the checkpoint."""
    from conftest import REPO_ROOT, run_processes, trainer_flags

    from sdxl_trainer.state.trainer_state import read_trainer_state

    flags = trainer_flags(sample_cache_dir, tiny_pipeline_dir, tmp_path, "run", "--optimizer", "adamw", "--no-validation_loss",
                          "--max_train_updates", "1")
    seed_at = flags.index("--set_seed")
    run_processes(1, REPO_ROOT / "sdxl_FSDP_train.py", flags[:seed_at] + flags[seed_at + 2:])
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())["set_seed"]
    state = read_trainer_state(next((tmp_path / "run" / "checkpoints").glob("update_*")))
    assert isinstance(recorded, int) and recorded == state.seed


def test_a_seed_the_generators_cannot_take_is_refused(train_config_class, capsys):
    """--set_seed -1 was accepted, and the run ended in NumPy's "expected non-negative integer" traceback when it
    chose its validation split."""
    for seed in ("-1", str(2**63)):
        lines = error_lines(capsys, train_config_class, ["--cached_dataset_dirs", "c", "--set_seed", seed])
        assert f"--set_seed must be from 0 to 2^63-1 (the data order's generators take no negative seed), got {seed}" in lines[-1]
    assert parse_config(train_config_class, ["--cached_dataset_dirs", "c", "--set_seed", str(2**63 - 1)]).set_seed == 2**63 - 1


def test_a_quiet_rank_leaves_the_first_rank_time_to_name_a_bad_flag_then_names_it_itself(monkeypatch, capsys):
    """torchrun stops every rank at the first failure: a quiet rank that exited at once could stop the first
    rank before it printed, leaving a bad flag with no message on screen."""
    from sdxl_trainer.jobs.train_config import TrainConfig

    waits = []  # the quiet rank's waits, and what it had printed by then
    monkeypatch.setattr(sdxl_trainer.config.time, "sleep", lambda seconds: waits.append((seconds, capsys.readouterr())))
    with pytest.raises(SystemExit) as stopped:
        parse_config(TrainConfig, ["--cached_dataset_dirs", "c", "--learning_rate", "-1"], quiet=True)
    assert stopped.value.code == 2 and waits == [(sdxl_trainer.config.QUIET_RANK_GRACE_S, ("", ""))]  # silent for the whole grace
    message = capsys.readouterr().err.splitlines()
    assert message[-2].endswith(": error: invalid configuration:") and message[-1] == "  --learning_rate must be > 0, got -1.0"
    with pytest.raises(SystemExit) as stopped:  # a bad flag: one line, after the same wait
        parse_config(TrainConfig, ["--cached_dataset_dirs", "c", "--lr", "1e-4"], quiet=True)
    assert stopped.value.code == 2 and len(waits) == 2
    assert capsys.readouterr().err.endswith(": error: unknown flag --lr; did you mean --learning_rate? (--help lists every flag)\n")
    with pytest.raises(SystemExit) as stopped:  # --help: nothing from a quiet rank, no wait
        parse_config(TrainConfig, ["--help"], quiet=True)
    assert stopped.value.code == 0 and capsys.readouterr() == ("", "") and len(waits) == 2


# --- per-dataset records ([[datasets]]) and sections ------------------------------------------------------------


def test_datasets_tables_are_the_same_records_as_the_per_cache_flags(train_config_class, tmp_path):
    """A TOML [[datasets]] table per cache builds exactly the run the --cached_dataset_dirs / --dataset_* shorthand
    builds: the same data (caches, loss weights, repeats), caption variation per cache and real-image folders."""
    toml = toml_file(tmp_path, "\n".join([
        "encode_captions_each_step = true", "shuffle_caption = true", "",
        "[[datasets]]", 'cache_dir = "photos"', "repeats = 2", "loss_weight = 0.5", 'validation_source_dir = "real/photos"', "",
        "[[datasets]]", 'cache_dir = "tags"', "keep_tokens = 1", "caption_tag_dropout_rate = 0.25", "shuffle_caption = false",
        'validation_source_dir = "real/tags"',
    ]))
    from_tables = parse_config(train_config_class, ["--config", str(toml)])
    from_flags = parse_config(train_config_class, [
        "--cached_dataset_dirs", "photos", "tags", "--encode_captions_each_step", "--shuffle_caption", "--dataset_repeats", "2", "1",
        "--dataset_loss_weights", "0.5", "1", "--dataset_shuffle_caption", "true", "false", "--dataset_keep_tokens", "0", "1",
        "--dataset_caption_tag_dropout_rate", "0", "0.25", "--validation_source_dirs", "real/photos", "real/tags",
    ])
    assert from_tables.cache_dirs() == ["photos", "tags"]
    assert from_tables.data_settings() == from_flags.data_settings()
    assert from_tables.data_settings().loss_weights == [0.5, 1.0] and from_tables.data_settings().repeats == [2.0, 1.0]
    assert [(v.shuffle_tags, v.keep_tags, v.tag_dropout) for v in from_tables.caption_variations()] == [(True, 0, 0.0), (False, 1, 0.25)]
    assert from_tables.caption_variations() == from_flags.caption_variations()
    assert from_tables.evaluation_settings().source_dirs == [Path("real/photos"), Path("real/tags")] == from_flags.evaluation_settings().source_dirs
    resolved = config_to_dict(from_tables)
    assert resolved["datasets"][1] == {"cache_dir": "tags", "repeats": 1.0, "loss_weight": 1.0, "shuffle_caption": False, "keep_tokens": 1,
                                       "caption_tag_dropout_rate": 0.25, "validation_source_dir": "real/tags"}


@pytest.mark.parametrize(
    "table,flags,message",
    [
        ('[[datasets]]\ncache_dir = "a"\nrepeat = 2\n', [], "[[datasets]] number 1: unknown keys ['repeat']"),
        ("[[datasets]]\nrepeats = 2\n", [], "[[datasets]] number 1: missing cache_dir"),
        ('[[datasets]]\ncache_dir = "a"\nrepeats = "two"\n', [], "repeats = 'two' should be of type float"),
        ('[[datasets]]\ncache_dir = "a"\n', ["--cached_dataset_dirs", "b"], "give the caches either as [[datasets]] tables in --config or as --cached_dataset_dirs"),
        ('[[datasets]]\ncache_dir = "a"\n', ["--dataset_repeats", "2"], "not both: found --dataset_repeats"),
        ('[[datasets]]\ncache_dir = "a"\nrepeats = 0\n', [], "[[datasets]] number 1 (a): repeats and loss_weight must be > 0 and finite"),
        ('[[datasets]]\ncache_dir = "a"\nvalidation_source_dir = "real"\n[[datasets]]\ncache_dir = "b"\n', [],
         "give validation_source_dir for every cache or for none"),
        ('[[datasets]]\ncache_dir = "a"\nkeep_tokens = 2\n', [], "--dataset_keep_tokens vary captions at every step, which needs --encode_captions_each_step"),
        ("learning_rate = 1e-5\n", [], "no caches to train on: give --cached_dataset_dirs"),
    ],
)
def test_datasets_tables_are_checked_like_the_flags(train_config_class, tmp_path, capsys, table, flags, message):
    with pytest.raises(SystemExit):
        parse_config(train_config_class, ["--config", str(toml_file(tmp_path, table)), *flags])
    assert message in capsys.readouterr().err


def test_help_lists_each_section_under_its_title(train_config_class, capsys):
    """--help groups the trainer's flags by the section that owns them (each defined beside its component)."""
    with pytest.raises(SystemExit):
        parse_config(train_config_class, ["--help"])
    out = capsys.readouterr().out
    titles = ["Data: caches, batches, run length:", "Optimizer:", "Objective: noise, timesteps, target and loss:", "Checkpoints and resuming:"]
    positions = [out.index(title) for title in titles]
    assert positions == sorted(positions)
    objective = out[positions[2]:out.index("Caption mode and text-encoder training:")]
    assert "--noise_offset" in objective and "--learning_rate " not in objective
    assert "--datasets" not in out  # TOML tables only


def test_the_model_and_resolution_options_are_one_definition_for_both_scripts(train_config_class, cache_config_class):
    """The caching script and the trainer share the model and resolution sections; each resolves unset values its
    own way (caching: SDXL base, 512-1024 px; training: whatever the caches were made with)."""
    from sdxl_trainer.cache.buckets import ResolutionOptions
    from sdxl_trainer.models.options import ModelOptions

    for section in (ModelOptions, ResolutionOptions):
        assert issubclass(train_config_class, section) and issubclass(cache_config_class, section)
    caching = parse_config(cache_config_class, ["--cache_dir", "c", "--verify"])
    assert (caching.pretrained_model_name_or_path, caching.min_resolution, caching.max_resolution) == ("stabilityai/stable-diffusion-xl-base-1.0", 512, 1024)
    training = parse_config(train_config_class, ["--cached_dataset_dirs", "c"])
    assert (training.pretrained_model_name_or_path, training.min_resolution, training.max_resolution) == (None, None, None)



def fields_declared_twice(config_class: type) -> dict[str, list[str]]:
    """Fields that more than one of a config's sections (its dataclass bases, and the class itself) declare: a
    later section's declaration silently replaces an earlier one's default and help."""
    declared: dict[str, list[str]] = {}
    for section in config_class.__mro__:
        if dataclasses.is_dataclass(section):
            for name in section.__dict__.get("__annotations__", {}):
                if not name.isupper():  # ClassVar tables such as COMMON_OPTIONS are no fields
                    declared.setdefault(name, []).append(section.__name__)
    return {name: sections for name, sections in declared.items() if len(sections) > 1}


def test_no_two_config_sections_declare_the_same_field(train_config_class, cache_config_class):
    from sdxl_trainer.jobs.convert_config import ConvertConfig
    from sdxl_trainer.jobs.extract_config import ExtractConfig

    for config_class in (train_config_class, cache_config_class, ConvertConfig, ExtractConfig):
        assert fields_declared_twice(config_class) == {}, config_class.__name__

    @dataclass(kw_only=True)
    class First:
        seed: int = option(0, help="a seed")

    @dataclass(kw_only=True)
    class Second:
        seed: int = option(1, help="another seed")

    @dataclass(kw_only=True)
    class Both(First, Second):
        pass

    assert fields_declared_twice(Both) == {"seed": ["First", "Second"]}

# --- the command line as a new user meets it -----------------------------------------------------------------


def error_lines(capsys, config_class, argv: list[str]) -> list[str]:
    """Parse expecting a usage error (exit 2); returns its stderr lines."""
    with pytest.raises(SystemExit) as info:
        parse_config(config_class, argv)
    assert info.value.code == 2
    return capsys.readouterr().err.rstrip("\n").splitlines()


def test_flags_are_matched_exactly_never_as_abbreviations(train_config_class, capsys):
    """argparse's prefix matching took --lr for --lr_num_cycles: its error named a flag never typed, and
    `--lr 5` trained with 5 cosine restarts instead of a learning rate."""
    for argv in (["--lr", "1e-4"], ["--lr", "5"], ["--lr=5"]):
        [line] = error_lines(capsys, train_config_class, ["--cached_dataset_dirs", "c", *argv])
        assert line.endswith(": error: unknown flag --lr; did you mean --learning_rate? (--help lists every flag)"), line
    [line] = error_lines(capsys, ExampleConfig, ["--data_dir", "d", "--step", "3"])  # a prefix of --steps
    assert line.endswith(": error: unknown flag --step; did you mean --steps? (--help lists every flag)")


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--learning_rat", "1e-5"], "unknown flag --learning_rat; did you mean --learning_rate?"),
        (["--no-gradient_checkpoint"], "unknown flag --no-gradient_checkpoint; did you mean --no-gradient_checkpointing?"),
        (["--xyzzy", "1"], "unknown flag --xyzzy (--help lists every flag)"),
        (["--train_batch_size", "4", "8"], "unexpected argument 8 (--help lists every flag)"),
        (["--mixed_precision", "bf15"], "argument --mixed_precision: invalid choice: 'bf15' (choose from 'auto', 'bf16', 'fp16', 'fp32')"),
        (["--train_batch_size", "four"], "argument --train_batch_size: invalid int value: 'four'"),
    ],
)
def test_a_bad_flag_or_value_is_one_line_naming_it_and_the_fix(train_config_class, capsys, argv, expected):
    """The 110-line usage block that came before the one useful line is gone: one line, naming the flag and the
    closest real one, or the valid values."""
    [line] = error_lines(capsys, train_config_class, ["--cached_dataset_dirs", "c", *argv])
    assert expected in line and "usage:" not in line


def test_an_unknown_toml_key_names_the_closest_real_one(tmp_path, capsys):
    err = parse_error(capsys, ["--config", str(toml_file(tmp_path, 'data_dir = "d"\nlerning_rate = 0.1\n'))])
    assert "unknown keys ['lerning_rate'] (did you mean learning_rate?)" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "config_fixture,script,common",
    [
        ("train_config_class", "sdxl_FSDP_train.py", ["--config", "--cached_dataset_dirs", "--output_dir", "--learning_rate", "--load_saved_state"]),
        ("cache_config_class", "sdxl_process_data_dir.py", ["--data_dir", "--cache_dir", "--pretrained_model_name_or_path", "--dry_run", "--verify"]),
    ],
)
def test_help_starts_with_what_the_script_does_and_its_common_options(config_fixture, script, common, request, capsys):
    """`--help | head -50` showed 50 lines of the 110-line usage block; now: a one-line usage, what the script
    does, the common options in a line each, then the full reference by section."""
    description = f"{script}'s first line of description."
    with pytest.raises(SystemExit) as info:
        parse_config(request.getfixturevalue(config_fixture), ["--help"], description=description)
    assert info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("usage: ") and lines[1] == "" and lines[2] == description
    head = lines[:50]
    start = head.index(next(line for line in head if line.startswith("Common options")))
    listed = [line.split()[0] for line in head[start + 1:] if line.startswith("  --")]
    assert set(common) <= set(listed), listed
    assert all(len(line) <= 120 for line in head)
    reference = lines.index("options:")
    assert reference > start and "  -h, --help" in lines[reference + 1]


# --- finite numbers --------------------------------------------------------------------------------------------


def float_options(config_class) -> dict[str, bool]:
    """Every float and list-of-float option of a script's config, and whether it is a list (a [[datasets]] record's
    are checked below)."""
    import typing

    from sdxl_trainer.config import _unwrap_optional

    hints = typing.get_type_hints(config_class)
    found = {}
    for field in dataclasses.fields(config_class):
        base, _ = _unwrap_optional(hints[field.name])
        if base is float or (typing.get_origin(base) is list and typing.get_args(base)[0] is float):
            found[field.name] = base is not float
    return found


def script_configs():
    from sdxl_trainer.jobs.cache_config import CacheConfig
    from sdxl_trainer.jobs.convert_config import ConvertConfig
    from sdxl_trainer.jobs.extract_config import ExtractConfig
    from sdxl_trainer.jobs.train_config import TrainConfig

    return [TrainConfig, CacheConfig, ExtractConfig, ConvertConfig]


def test_a_rate_or_weight_of_infinity_or_nan_is_refused_on_the_command_line_and_in_toml(tmp_path, capsys):
    """`--learning_rate inf` trained (nan and -1 were refused by its range check, inf passed `> 0`) and the run
    exported a UNet of non-finite values. Every float option refuses infinity and NaN as the parser reads it, on
    the command line and in a TOML file (whose `inf` and `nan` are numbers too), list items and [[datasets]] keys
    included."""
    train_config = script_configs()[0]
    for value in ("inf", "-inf", "nan", "NaN", "1e999", "infinity"):
        [line] = error_lines(capsys, train_config, [f"--learning_rate={value}"])
        assert line.endswith(f"error: argument --learning_rate: {value} is not a finite number"), line
    [line] = error_lines(capsys, train_config, ["--dataset_loss_weights", "1", "nan"])
    assert line.endswith("error: argument --dataset_loss_weights: nan is not a finite number"), line
    for text, expected in (("learning_rate = inf", "learning_rate = inf is not a finite number"),
                           ("dataset_repeats = [1, nan]", "dataset_repeats = [1, nan]: nan is not a finite number")):
        [line] = error_lines(capsys, train_config, ["--config", str(toml_file(tmp_path, text + "\n"))])
        assert line.endswith(expected), line
    for key in ("repeats", "loss_weight", "caption_tag_dropout_rate"):
        toml = toml_file(tmp_path, f'[[datasets]]\ncache_dir = "a"\n{key} = -inf\n')
        [line] = error_lines(capsys, train_config, ["--config", str(toml)])
        assert line.endswith(f"[[datasets]] number 1: {key} = -inf is not a finite number"), line


@pytest.mark.slow  # some 80 parses of the scripts' full configs
def test_every_float_option_of_every_script_refuses_infinity(tmp_path, capsys):
    """The same for every float option of the four scripts, found from their configs' types: none is left out."""
    checked = 0
    for config_class in script_configs():
        options = float_options(config_class)
        assert config_class.__name__ == "ConvertConfig" or options, config_class
        for name, is_list in options.items():
            [line] = error_lines(capsys, config_class, [f"--{name}=inf"])
            assert line.endswith(f"error: argument --{name}: inf is not a finite number"), line
            toml = toml_file(tmp_path, f"{name} = {'[1.0, inf]' if is_list else 'nan'}\n")
            [line] = error_lines(capsys, config_class, ["--config", str(toml)])
            assert f"{name} = " in line and "is not a finite number" in line, line
            checked += 1
    assert checked >= 30  # the trainer's rates, weights, shares and scales, the caching script's scores, the extractor's threshold
