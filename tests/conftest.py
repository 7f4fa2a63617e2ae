"""Shared test setup: an offline-safe environment and the paths of the shared fixtures."""

import logging
import os
import socket
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

# Module level, so it holds before any test module imports tiktoken, wandb or ray.
os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(SHARED_DATA / "tiktoken_cache"))
os.environ["WANDB_MODE"] = "offline"
if "PYTEST_XDIST_WORKER" in os.environ:  # two workers on two cores: one torch thread each, no oversubscription
    os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups into the test ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under `-n 2 --dist loadgroup` (pyproject's addopts) the tests that start Ray run on one
    worker, one after another as they always have: their sweeps' timing and the one shared Ray
    instance stay as on a single process, while the other worker takes the compile-bound tests."""
    for item in items:
        if item.get_closest_marker("ray"):
            item.add_marker(pytest.mark.xdist_group("ray"))


@pytest.fixture
def eager_kernels(monkeypatch):
    """The quantizer kernels run eagerly: every compiled graph costs seconds. Quantizer test modules
    make this their default (`pytestmark`); the compiled kernels are tested through `path`."""
    monkeypatch.setenv("ALTGRAD_NO_COMPILE", "1")


@pytest.fixture(params=["eager", "compiled"])
def path(request, monkeypatch, eager_kernels):
    """Run a quantizer test on the eager kernels or the torch.compile'd ones (and check that they
    really compiled)."""
    from altgrad.quant import compile_status

    if request.param == "compiled":
        monkeypatch.delenv("ALTGRAD_NO_COMPILE", raising=False)
    yield request.param
    if request.param == "compiled":
        assert compile_status() == "compiled"


@pytest.fixture(scope="session")
def eurlex_dir() -> Path:
    """Real EUR-Lex text: {train,validation,test}.jsonl with a 'text' field (420 documents)."""
    return SHARED_DATA / "eurlex"


@pytest.fixture(scope="session")
def data_root(tmp_path_factory) -> Path:
    """One prepared-dataset folder for the whole session (tokenizing is the slow part)."""
    return tmp_path_factory.mktemp("data")


@pytest.fixture
def make_config(eurlex_dir, data_root):
    """`make_config("quant.format=e5m2", ...)`: a cpu-preset RunConfig on the EUR-Lex fixtures."""
    from altgrad.config import build_run_config

    base = [
        f"data.source=jsonl:{eurlex_dir}",
        f"data.data_root={data_root}",
        "data.max_docs=40",
        "model.block_size=32",
        "train.batch_size=4",
        "train.max_steps=20",
        "train.warmup_steps=2",
        "train.eval_iters=2",
    ]

    def make(*overrides: str):
        return build_run_config({"preset": "cpu"}, [*base, *overrides])

    return make


@pytest.fixture
def experiment(tmp_path) -> Path:
    """An experiment of six grid points written by hand (`experiment_files.six_trial_experiment`):
    completed, cut by ASHA, stopped for NaN, running, errored, never started."""
    from experiment_files import six_trial_experiment

    return six_trial_experiment(tmp_path)


@pytest.fixture(scope="session")
def ray_address():
    """One Ray instance for the whole session (starting one costs seconds); its GCS address lets
    sweep drivers in subprocesses join it through RAY_ADDRESS. Its nodes, and so every trial
    process, get `sweep_helpers.TRIALS_ENV` (set while they start; this process keeps its own)."""
    import ray
    from sweep_helpers import TRIALS_ENV

    with pytest.MonkeyPatch.context() as env:
        for k, v in TRIALS_ENV.items():
            env.setenv(k, v)
        context = ray.init(num_cpus=2, include_dashboard=False)
    yield context.address_info["gcs_address"]
    ray.shutdown()


@pytest.fixture(scope="session")
def sweep_args(eurlex_dir, data_root) -> list[str]:
    """The sweep tests' command-line overrides (`sweep_helpers.tiny_sweep`)."""
    from sweep_helpers import tiny_sweep

    return tiny_sweep(eurlex_dir, data_root)


@pytest.fixture(scope="session")
def s3_bucket():
    """A real S3-compatible server (moto's) on 127.0.0.1 with one bucket; the AWS variables that
    point pyarrow (and so Ray, and every driver the tests start) at it are set for the session.
    Yields the bucket's URI."""
    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one INFO line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "altgrad", "AWS_SECRET_ACCESS_KEY": "altgrad", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    boto3.client("s3").create_bucket(Bucket="altgrad-sweeps")
    yield "s3://altgrad-sweeps"
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
