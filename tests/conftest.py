"""Shared fixtures: the tiny SDXL pipeline and a cache of sample_dataset/ made with it (made once per run, see made_once)."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import multiprocessing.process
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import pytest

# One thread per pytest worker: the suite runs as many workers as cores (run_tests.sh), and the processes the
# tests start use one thread each (process_env), so more would only make them wait for each other.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from warm_launch import WarmLauncher

from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir  # noqa: E402 - as below

from sdxl_trainer.distributed.world import free_port  # noqa: E402 - torch reads OMP_NUM_THREADS when it loads

REPO_ROOT = Path(__file__).resolve().parent.parent
SAMPLE_DATASET = REPO_ROOT / "sample_dataset"
# Small enough for CPU tests (a 40x40 latent is a third of the 64x64 one's update time), wide enough for two
# resolution categories and several aspect buckets; the two sample images below 256 px are skipped.
MIN_RESOLUTION, MAX_RESOLUTION = 256, 320
SAMPLE_RESOLUTION_FLAGS = ["--min_resolution", str(MIN_RESOLUTION), "--max_resolution", str(MAX_RESOLUTION)]

os.environ.setdefault("HF_HUB_OFFLINE", "1")


# The files that take longest (`bash run_tests.sh --durations=0`, summed per file), handed out first.
# xdist gives each worker whole files (--dist loadfile); by default it starts with the files of most tests,
# which left the 2-minute quickstart (one test) for last while the other worker had nothing left to run.
LONGEST_FILES = ("test_checkpoint.py", "test_faults.py", "test_launch.py", "test_text_encoder_training.py", "test_end_to_end.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    first = {name: position for position, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: files and tests otherwise in collection order


DISTRIBUTED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHINDUCTOR_CACHE_DIR")


@pytest.fixture(scope="module")
def world():
    """A 1-process gloo group in this process (FSDP2 shards everything on one rank), torn down after the module."""
    from sdxl_trainer.distributed.world import init_distributed, shutdown_distributed

    saved = {name: os.environ.get(name) for name in DISTRIBUTED_ENV}
    world = init_distributed()
    yield world
    shutdown_distributed()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """The folder `name`, made by make(folder) once for the whole run: the first pytest worker to ask makes it
    while the others wait, instead of each worker making its own (the tiny pipeline, the sample caches and the
    reference runs: some 10-40 s each). Tests read these folders and never write into them."""
    # A worker's base folder is pytest-N/popen-gwK: its parent is this run's alone. Without workers, the
    # parent holds earlier runs' folders, so the base itself is used.
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if make() fails
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a worker that failed to make it left
            make(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def tiny_pipeline_dir(tmp_path_factory) -> Path:
    from sdxl_trainer.models.tiny import save_tiny_pipeline

    return made_once(tmp_path_factory, "tiny", lambda folder: save_tiny_pipeline(folder / "tiny_sdxl", seed=0)) / "tiny_sdxl"


def process_data_dir(argv: list[str]) -> int:
    """sdxl_process_data_dir.py's main in this process: its flags parsed, then the caching job."""
    from sdxl_trainer.config import parse_config
    from sdxl_trainer.jobs.cache_config import CacheConfig
    from sdxl_trainer.jobs.cache_job import run_caching

    return run_caching(parse_config(CacheConfig, argv))


def cache_sample_dataset(cache_dir: Path, pipeline_dir: Path) -> None:
    exit_code = process_data_dir(
        ["--data_dir", str(SAMPLE_DATASET), "--cache_dir", str(cache_dir), "--pretrained_model_name_or_path", str(pipeline_dir), *SAMPLE_RESOLUTION_FLAGS]
    )
    assert exit_code == 0


@pytest.fixture(scope="session")
def sample_cache_dir(tmp_path_factory, tiny_pipeline_dir) -> Path:
    return made_once(tmp_path_factory, "sample_cache", lambda folder: cache_sample_dataset(folder, tiny_pipeline_dir))


def launcher_command(num_processes: int, script: Path, args: list[str]) -> list[str]:
    """torchrun with num_processes CPU processes (gloo), through sdxl_trainer.distributed.launcher as train.sh runs it."""
    return [
        sys.executable, "-m", "sdxl_trainer.distributed.launcher",
        "--nproc_per_node", str(num_processes),
        "--master_addr", "127.0.0.1",
        "--master_port", str(free_port()),
        str(script), *args,
    ]


def process_env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO_ROOT))


# run_tests.sh --quick: the tier without process launches (pytest.ini's markers say which tests are left out).
QUICK_TIER = os.environ.get("QUICK_TIER") == "1"
STARTS_PROCESSES = "starts processes: mark it @pytest.mark.multiprocess (the quick tier, run_tests.sh --quick, starts none)"


@functools.cache
def warm_launcher() -> WarmLauncher:
    if QUICK_TIER:
        raise AssertionError(f"This test {STARTS_PROCESSES}")
    return WarmLauncher(process_env())


@pytest.fixture(scope="session", autouse=True)
def start_the_warm_launcher_early() -> None:
    """Its server imports (some 30 s) while this worker makes or waits for the shared folders (made_once)."""
    if not QUICK_TIER:
        warm_launcher()


# What the quick tier refuses: Python processes (scripts, ranks, servers), shells, and forks (multiprocessing).
# torch.compile's own helpers start processes too and are allowed: the C++ compiler, openssl, its compile workers,
# and, on an empty compile cache, a Python process that loads a test library from that cache (its CPU check).
LAUNCHERS = ("python", "bash", "sh", "torchrun")


def _is_launch(command: str) -> bool:
    program = Path(command.split(" ", 1)[0]).name
    compilers_own = "torch._inductor" in command or inductor_cache_dir() in command
    return command.startswith("os.") or (program.startswith(LAUNCHERS) and not compilers_own)


started_processes: list[str] = []  # what the current test started (the audit hook below), quick tier only


def _record_process_start(event: str, args: tuple) -> None:
    """A Python audit hook (PEP 578): every subprocess, fork and spawn of this process, as it starts."""
    if event == "subprocess.Popen":
        started_processes.append(" ".join(map(str, args[1] if isinstance(args[1], (list, tuple)) else [args[1]])))
    elif event in ("os.fork", "os.forkpty", "os.posix_spawn", "os.spawn"):
        started_processes.append(event)


if QUICK_TIER:
    sys.addaudithook(_record_process_start)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """In the quick tier a test that starts a process (other than the compiler's) fails, naming the marker it needs."""
    started_processes.clear()
    outcome = yield
    launched = [command for command in started_processes if _is_launch(command)]
    if QUICK_TIER and outcome.excinfo is None and launched:
        outcome.force_exception(AssertionError(f"{item.nodeid} {STARTS_PROCESSES}; it started: {launched[0][:200]}"))


def run_processes(
    num_processes: int, script: Path, args: list[str], timeout: float = 600, expect_success: bool = True, prefix: tuple[str, ...] = (),
    through_launcher: bool = False, while_running: Callable[[list[multiprocessing.process.BaseProcess]], None] | None = None,
    merge_output: bool = False,
) -> subprocess.CompletedProcess:
    """Run `script` on num_processes CPU processes (gloo), as train.sh does: forked from the session's warm
    launcher (warm_launch.py), or `through_launcher`, or with a `prefix` that wraps the launcher, with torchrun.
    `while_running` (warm launcher only) gets the ranks' processes while they run; `merge_output` (warm launcher
    only) gives stdout and stderr as one stream in the result's stdout, in the order written, as in a log of `2>&1`."""
    if through_launcher or prefix:
        command = [*prefix, *launcher_command(num_processes, script, args)]
        result = subprocess.run(command, cwd=REPO_ROOT, env=process_env(), capture_output=True, text=True, timeout=timeout)
    else:
        result = warm_launcher().run(num_processes, script, args, process_env(), REPO_ROOT, timeout, while_running, merge_output)
    if expect_success:
        assert result.returncode == 0, f"{script.name} failed on {num_processes} processes:\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    return result


def train_sample_run(num_processes: int, per_rank_batch: int, cache_dir: Path | str, pipeline_dir: Path, output_dir: Path, *extra: str) -> None:
    """The reference run of test_distributed.py and test_object_storage.py (an 8-item epoch, 2 microbatches per update)."""
    run_processes(
        num_processes,
        REPO_ROOT / "sdxl_FSDP_train.py",
        [
            "--learning_rate_scheduler", "cosine", "--percent_lr_warm_up_steps", "0.25",
            "--cached_dataset_dirs", str(cache_dir),
            "--pretrained_model_name_or_path", str(pipeline_dir),
            *SAMPLE_RESOLUTION_FLAGS,
            "--train_batch_size", str(per_rank_batch),
            "--gradient_accumulation_steps", "2",
            "--num_train_epochs", "1",
            "--optimizer", "adamw", "--learning_rate", "1e-4", "--mixed_precision", "fp32", "--no-save_samples", "--no-validation_image",
            "--no-gradient_checkpointing",  # LIGHT_RUN_FLAGS less the export, which these runs compare
            "--conditional_dropout_percent", "0.5",
            "--dataloader_num_workers", "0",
            "--set_seed", "7",
            "--save_precision", "fp32",
            "--output_dir", str(output_dir), "--project_name", "run",
            *(() if "--log_every_n_updates" in extra else ("--log_every_n_updates", "1")),  # as trainer_flags
            *extra,
        ],
    )


@pytest.fixture(scope="session")
def runs_on_one_and_two_processes(tmp_path_factory, sample_cache_dir, tiny_pipeline_dir) -> dict[int, Path]:
    """train_sample_run on 1 process (batch 2) and on 2 (batch 1 each): the run folders."""

    def train_both(output_dir: Path) -> None:
        train_sample_run(1, 2, sample_cache_dir, tiny_pipeline_dir, output_dir / "one")
        train_sample_run(2, 1, sample_cache_dir, tiny_pipeline_dir, output_dir / "two")

    output_dir = made_once(tmp_path_factory, "one_vs_two", train_both)
    return {1: output_dir / "one" / "run", 2: output_dir / "two" / "run"}


# What most test runs leave out: gradient checkpointing's recomputed forward (a fifth of a tiny update's CPU
# time) and the pipeline export (some 2 CPU seconds a run). A test of either passes --gradient_checkpointing
# or --save_diffusers after these (the last flag wins); the quickstart runs both as users do.
LIGHT_RUN_FLAGS = ("--no-gradient_checkpointing", "--no-save_diffusers")


def trainer_flags(cache_dir: Path | list[Path], pipeline_dir: Path, output_dir: Path, project: str, *extra: str) -> list[str]:
    cache_dirs = cache_dir if isinstance(cache_dir, list) else [cache_dir]
    return [
        "--cached_dataset_dirs", *(str(path) for path in cache_dirs),
        "--pretrained_model_name_or_path", str(pipeline_dir),  # the resolution range comes from the cache
        "--output_dir", str(output_dir), "--project_name", project,
        "--train_batch_size", "1", "--mixed_precision", "fp32", "--set_seed", "5", "--learning_rate", "1e-4",
        "--dataloader_num_workers", "0", "--save_precision", "fp32", "--save_model_every_n_epochs", "0",
        "--no-save_samples", "--no-validation_image", *LIGHT_RUN_FLAGS,
        # The tests read every update's scalars (TensorBoard), unless they choose a cadence of their own.
        *(() if "--log_every_n_updates" in extra else ("--log_every_n_updates", "1")),
        *extra,
    ]


def scalars(run_dir: Path, tag: str) -> list[float]:
    """The values of one TensorBoard scalar of a run, in logging order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [event.value for event in events.Scalars(tag)]


def small_filesystem_prefix(mount_dir: Path, copy_to: Path, size: str) -> tuple[str, ...]:
    """A command prefix that runs the command with a fresh tmpfs of `size` mounted at mount_dir (a full disk
    on demand), in a private mount namespace, then copies what was written there to copy_to. Skips the test
    where this machine allows no user namespaces."""
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here for a small filesystem: {probe.stderr.decode().strip()}")
    mount_dir.mkdir(parents=True, exist_ok=True)
    copy_to.mkdir(parents=True, exist_ok=True)
    script = 'size=$1 mount_dir=$2 copy_to=$3; shift 3; mount -t tmpfs -o size="$size" tmpfs "$mount_dir" || exit 99; "$@"; code=$?; cp -a "$mount_dir/." "$copy_to"; exit $code'
    return ("unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh", size, str(mount_dir), str(copy_to))


@contextlib.contextmanager
def unprivileged():
    """Run the block as an ordinary user, so file permissions apply (root reads anything): as user nobody
    when the tests run as root, unchanged otherwise. Files it must reach need to be under public_tmp_path."""
    if os.geteuid() != 0:
        yield
        return
    os.setegid(65534)
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


@pytest.fixture(scope="session")
def tag_cache(tmp_path_factory, tiny_pipeline_dir) -> Path:
    """sample_dataset/ with tag captions (every third file holds two, one per line), cached."""
    def make(root: Path) -> None:
        data_dir = root / "data"
        shutil.copytree(SAMPLE_DATASET, data_dir)
        for index, caption_path in enumerate(sorted(data_dir.rglob("*.txt"))):
            words = caption_path.read_text().replace(",", "").split()[:6]
            tags = ", ".join(["sample", *words])
            caption_path.write_text(f"{tags}\nsample, another caption {index}\n" if index % 3 == 0 else tags)
        assert process_data_dir(
            ["--data_dir", str(data_dir), "--cache_dir", str(root / "cache"), "--pretrained_model_name_or_path", str(tiny_pipeline_dir),
             *SAMPLE_RESOLUTION_FLAGS]
        ) == 0

    return made_once(tmp_path_factory, "tags", make) / "cache"


@pytest.fixture(scope="session")
def table_cache(tmp_path_factory, tiny_pipeline_dir) -> Path:
    """Seven sample images listed in a Parquet table (tag lists, scores; no caption files), cached with score tags."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def make(root: Path) -> None:
        images = root / "images"
        images.mkdir(parents=True)
        rows = []
        for index in range(7):
            for image in SAMPLE_DATASET.glob(f"sample_{index:02d}.*"):
                if image.suffix != ".txt":
                    shutil.copy(image, images)
                    words = image.with_suffix(".txt").read_text().replace(",", "").split()[:5]
                    rows.append({"path": image.name, "tags": ["table", *words], "score": 100.0 * index})
        pq.write_table(pa.Table.from_pylist(rows), root / "meta.parquet", row_group_size=3)
        assert process_data_dir(
            ["--data_dir", str(images), "--metadata_table", str(root / "meta.parquet"), "--score_tags", "300", "100", "--cache_dir", str(root / "cache"),
             "--pretrained_model_name_or_path", str(tiny_pipeline_dir), *SAMPLE_RESOLUTION_FLAGS]
        ) == 0

    return made_once(tmp_path_factory, "table", make) / "cache"


@pytest.fixture
def public_tmp_path() -> Path:
    """A temporary folder an ordinary user can enter (pytest's own are private to the user who runs the tests)."""
    # In the system's temporary folder itself: pytest's own folder above the base is private too.
    path = Path(tempfile.mkdtemp(prefix="public-", dir=tempfile.gettempdir()))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)
