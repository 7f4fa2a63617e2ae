"""Data pipeline (SPEC §4): prepared token files, idempotency and locking, and batches that are
a pure function of (seed, step)."""

import hashlib
import json
import multiprocessing
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import requests
import tiktoken
import torch

from altgrad.data import EOT, DataError, TokenBatches, prepare_dataset


def data_cfg(source: str, data_root: Path, **kw) -> SimpleNamespace:
    """The fields of altgrad.config.DataConfig, as prepare_dataset reads them."""
    fields = {"name": None, "max_docs": None, "val_split": "validation"} | kw
    return SimpleNamespace(source=source, data_root=str(data_root), **fields)


def read_texts(path: Path, n: int | None = None) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text().splitlines()][:n]


def mtimes(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in d.iterdir()}


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture(scope="module")
def small_dataset(eurlex_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    return prepare_dataset(data_cfg(f"jsonl:{eurlex_dir}", root, max_docs=20))


# --- prepare -------------------------------------------------------------------------------------


def test_prepare_jsonl_writes_tokens_meta_and_honours_max_docs(small_dataset, eurlex_dir):
    meta = json.loads((small_dataset / "meta.json").read_text())
    assert meta["docs"] == {"train": 20, "val": 20}
    assert meta["max_docs"] == 20 and meta["tokenizer"] == "gpt2"
    assert meta["source"] == f"jsonl:{eurlex_dir.resolve()}"
    enc = tiktoken.get_encoding("gpt2")
    for split, src in (("train", "train.jsonl"), ("val", "validation.jsonl")):
        raw = (small_dataset / f"{split}.bin").read_bytes()
        assert hashlib.sha256(raw).hexdigest() == meta["sha256"][split]
        tokens = np.frombuffer(raw, dtype=np.uint16)
        assert len(tokens) == meta["tokens"][split]
        assert (tokens == EOT).sum() == 20 and tokens[-1] == EOT
        first = tokens[: np.flatnonzero(tokens == EOT)[0]]
        assert enc.decode(first.tolist()) == read_texts(eurlex_dir / src, 1)[0]


def test_full_jsonl_relative_to_cwd(eurlex_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(eurlex_dir.parent)
    out = prepare_dataset(data_cfg("jsonl:eurlex", tmp_path))
    meta = json.loads((out / "meta.json").read_text())
    assert out.parent == tmp_path and out.name.startswith("eurlex-jsonl-")
    assert meta["source"] == f"jsonl:{eurlex_dir.resolve()}"
    assert meta["docs"] == {"train": 354, "val": 34}  # test.jsonl is not used for training


def test_prepare_is_idempotent_and_rebuilds_on_change(eurlex_dir, tmp_path):
    cfg = data_cfg(f"jsonl:{eurlex_dir}", tmp_path, max_docs=3)
    out = prepare_dataset(cfg)
    before = mtimes(out)
    assert prepare_dataset(cfg) == out and mtimes(out) == before

    # A derived name includes max_docs: a new cap is a new dataset, the old one stays.
    other = prepare_dataset(data_cfg(f"jsonl:{eurlex_dir}", tmp_path, max_docs=4))
    assert other != out and mtimes(out) == before
    assert json.loads((other / "meta.json").read_text())["docs"]["train"] == 4

    # An explicit name with a new cap is rebuilt in place.
    named = data_cfg(f"jsonl:{eurlex_dir}", tmp_path, name="mine", max_docs=3)
    assert prepare_dataset(named) == tmp_path / "mine"
    prepare_dataset(data_cfg(f"jsonl:{eurlex_dir}", tmp_path, name="mine", max_docs=5))
    meta = json.loads((tmp_path / "mine" / "meta.json").read_text())
    assert meta["max_docs"] == 5 and meta["docs"] == {"train": 5, "val": 5}

    # A damaged file no longer matches meta.json and is rebuilt.
    (out / "train.bin").write_bytes(b"\0\0")
    prepare_dataset(cfg)
    sha = hashlib.sha256((out / "train.bin").read_bytes()).hexdigest()
    assert sha == json.loads((out / "meta.json").read_text())["sha256"]["train"]
    assert not list(tmp_path.rglob("*.tmp"))


def _prepare_and_sample(cfg, barrier, results) -> None:
    """Child process: a trial that prepares the shared dataset, then draws one batch."""
    barrier.wait(timeout=60)
    out = prepare_dataset(cfg)
    st = (out / "meta.json").stat()
    x, _ = TokenBatches(out, block_size=16, batch_size=2, seed=3).train_batch(7)
    results.put((st.st_ino, st.st_mtime_ns, x.tolist()))


def test_parallel_prepare_happens_once(eurlex_dir, tmp_path):
    cfg = data_cfg(f"jsonl:{eurlex_dir}", tmp_path, max_docs=40)
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [
        ctx.Process(target=_prepare_and_sample, args=(cfg, barrier, results)) for _ in range(2)
    ]
    try:
        for p in procs:
            p.start()
        for p in procs:  # results are tiny, so joining before draining the queue cannot block
            p.join(timeout=120)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    got = [results.get(timeout=5) for _ in procs]
    # Both saw the same meta.json (the second waited on the lock and found it ready) ...
    assert got[0][:2] == got[1][:2]
    out = prepare_dataset(cfg)
    meta = json.loads((out / "meta.json").read_text())
    for split in ("train", "val"):
        assert (
            hashlib.sha256((out / f"{split}.bin").read_bytes()).hexdigest() == meta["sha256"][split]
        )
    assert not list(tmp_path.rglob("*.tmp"))
    # ... and batches are identical across processes (no per-process hash seeding).
    x, _ = TokenBatches(out, block_size=16, batch_size=2, seed=3).train_batch(7)
    assert got[0][2] == got[1][2] == x.tolist()


# --- hf source -----------------------------------------------------------------------------------


def test_hf_source_loads_multi_eurlex_and_honours_max_docs(eurlex_dir, tmp_path, monkeypatch):
    import datasets  # imported here: spawned children of the parallel test import this module

    fake = datasets.DatasetDict(
        {
            split: datasets.Dataset.from_dict(
                {"text": read_texts(eurlex_dir / f"{split}.jsonl", 12)}
            )
            for split in ("train", "validation", "test")
        }
    )
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **kw: calls.append((a, kw)) or fake)
    out = prepare_dataset(data_cfg("hf", tmp_path, max_docs=7))
    assert calls == [(("coastalcph/multi_eurlex", "en"), {})]
    assert out == tmp_path / "eurlex-hf-n7"
    meta = json.loads((out / "meta.json").read_text())
    assert meta["source"] == "hf" and meta["docs"] == {"train": 7, "val": 7}
    tokens = np.fromfile(out / "train.bin", dtype=np.uint16)
    enc = tiktoken.get_encoding("gpt2")
    assert tokens.tolist() == [
        t for text in fake["train"]["text"][:7] for t in (*enc.encode_ordinary(text), EOT)
    ]


@pytest.mark.parametrize("kind", ["unreachable", "not_cached", "offline_env"])
def test_hf_offline_names_the_fix(tmp_path, monkeypatch, kind):
    import datasets
    from huggingface_hub.utils import LocalEntryNotFoundError

    error = {
        "unreachable": ConnectionError("Couldn't reach 'coastalcph/multi_eurlex' on the Hub"),
        "not_cached": LocalEntryNotFoundError("outgoing traffic has been disabled"),
        "offline_env": FileNotFoundError("no cached dataset"),  # only offline with HF_HUB_OFFLINE
    }[kind]
    if kind == "offline_env":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def offline(*args, **kwargs):
        raise error

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match="cannot download coastalcph/multi_eurlex") as exc:
        prepare_dataset(data_cfg("hf", tmp_path))
    assert "HF_HOME" in str(exc.value) and "data.source=jsonl:DIR" in str(exc.value)
    assert ("HF_HUB_OFFLINE is set" in str(exc.value)) == (kind == "offline_env")
    assert not (tmp_path / "eurlex-hf").exists()


def test_missing_tokenizer_files_name_the_cache_dir(eurlex_dir, tmp_path, monkeypatch):
    def no_bpe(name):
        raise requests.exceptions.ConnectionError(
            "Failed to resolve 'openaipublic.blob.core.windows.net'"
        )

    monkeypatch.setattr(tiktoken, "get_encoding", no_bpe)
    with pytest.raises(DataError, match="TIKTOKEN_CACHE_DIR"):
        prepare_dataset(data_cfg(f"jsonl:{eurlex_dir}", tmp_path, max_docs=1))


# --- user errors ---------------------------------------------------------------------------------


def test_missing_jsonl_dir_writes_nothing(tmp_path):
    root = tmp_path / "data"
    with pytest.raises(DataError, match="does not exist"):
        prepare_dataset(data_cfg(f"jsonl:{tmp_path / 'nope'}", root))
    assert not root.exists()


def test_missing_validation_file(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"text": "a"}])
    with pytest.raises(DataError, match="validation.jsonl is missing"):
        prepare_dataset(data_cfg(f"jsonl:{tmp_path}", tmp_path / "data"))


def test_missing_text_field_names_file_and_line(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"text": "fine"}, {"body": "no text"}])
    write_jsonl(tmp_path / "validation.jsonl", [{"text": "fine"}])
    with pytest.raises(DataError, match=r"train\.jsonl:2: no string 'text' field"):
        prepare_dataset(data_cfg(f"jsonl:{tmp_path}", tmp_path / "data"))
    assert not list((tmp_path / "data").rglob("*.bin*"))


def test_a_byte_that_is_not_utf8_names_file_and_line(tmp_path):
    (tmp_path / "train.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')  # Latin-1
    write_jsonl(tmp_path / "validation.jsonl", [{"text": "fine"}])
    with pytest.raises(DataError, match=r"train\.jsonl:2: not UTF-8 text \(invalid continuation byte at "
                                        r"byte 14 of the line\)\. Fix: save the file as UTF-8"):
        prepare_dataset(data_cfg(f"jsonl:{tmp_path}", tmp_path / "data"))
    assert not list((tmp_path / "data").rglob("*.bin*"))


@pytest.mark.parametrize("data_root", ["file", "file/below", "/proc/altgrad-data"])
def test_a_data_root_that_cannot_be_a_folder(eurlex_dir, tmp_path, data_root):
    """A file where data_root (or a folder above it) would be, or a place that holds no folders."""
    (tmp_path / "file").write_text("mine")
    with pytest.raises(DataError, match=f"data.data_root='[^']*{re.escape(data_root)}': cannot make the folder .*Fix: "):
        prepare_dataset(data_cfg(f"jsonl:{eurlex_dir}", tmp_path / data_root))
    assert (tmp_path / "file").read_text() == "mine"


def test_empty_split(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"text": "fine"}])
    (tmp_path / "validation.jsonl").write_text("")
    with pytest.raises(DataError, match="'validation' .* has no documents"):
        prepare_dataset(data_cfg(f"jsonl:{tmp_path}", tmp_path / "data"))


def test_unknown_source(tmp_path):
    with pytest.raises(DataError, match="data.source='s3://bucket'"):
        prepare_dataset(data_cfg("s3://bucket", tmp_path))


def test_block_size_larger_than_val_split(eurlex_dir, tmp_path):
    write_jsonl(
        tmp_path / "train.jsonl", [{"text": t} for t in read_texts(eurlex_dir / "train.jsonl", 2)]
    )
    write_jsonl(tmp_path / "validation.jsonl", [{"text": "Short text."}])
    out = prepare_dataset(data_cfg(f"jsonl:{tmp_path}", tmp_path / "data"))
    with pytest.raises(DataError, match="block_size=64 .* val split .* model.block_size"):
        TokenBatches(out, block_size=64, batch_size=2, seed=0)


def test_unprepared_dir(tmp_path):
    with pytest.raises(DataError, match="prepare_dataset"):
        TokenBatches(tmp_path, block_size=8, batch_size=2, seed=0)


# --- batches -------------------------------------------------------------------------------------


def test_batches_are_a_pure_function_of_seed_and_step(small_dataset):
    a = TokenBatches(small_dataset, block_size=32, batch_size=4, seed=1)
    b = TokenBatches(small_dataset, block_size=32, batch_size=4, seed=1)  # e.g. another format
    torch.manual_seed(0)
    b5, b3 = b.train_batch(5), b.train_batch(3)  # out of order, other global RNG state
    torch.manual_seed(123)
    a3, a5 = a.train_batch(3), a.train_batch(5)
    for (xa, ya), (xb, yb) in ((a3, b3), (a5, b5)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a3[0], a5[0])
    other_seed = TokenBatches(small_dataset, block_size=32, batch_size=4, seed=2)
    assert not torch.equal(other_seed.train_batch(3)[0], a3[0])


def test_batch_shape_dtype_and_targets(small_dataset):
    tokens = np.fromfile(small_dataset / "train.bin", dtype=np.uint16)
    batches = TokenBatches(small_dataset, block_size=32, batch_size=4, seed=1)
    x, y = batches.train_batch(0)
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert batches.num_tokens("train") == len(tokens)
    windows = np.lib.stride_tricks.sliding_window_view(tokens, 33)
    for row_x, row_y in zip(x, y, strict=True):
        row = np.append(row_x.numpy(), row_y[-1].item())
        assert (windows == row).all(axis=1).any()  # a real window of the token stream


def test_val_batches_are_fixed(small_dataset):
    a = TokenBatches(small_dataset, block_size=32, batch_size=4, seed=1)
    first, again = a.val_batches(3), a.val_batches(3)
    assert len(first) == 3
    for (x1, y1), (x2, y2) in zip(first, again, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(first[0][0], first[1][0])


def test_val_set_is_the_same_for_every_seed_and_batch_order(small_dataset):
    """Two trials with different training seeds are scored on the same tokens, whatever training
    batches (or global RNG draws) came before, and however the windows are cut into batches."""
    torch.manual_seed(0)
    seed1 = TokenBatches(small_dataset, block_size=32, batch_size=4, seed=1).val_batches(6)
    other = TokenBatches(small_dataset, block_size=32, batch_size=4, seed=2)
    for step in (7, 0, 3):
        other.train_batch(step)
    torch.rand(100)
    seed2 = other.val_batches(6)
    regrouped = TokenBatches(small_dataset, block_size=32, batch_size=8, seed=3).val_batches(3)
    xs = [torch.cat([x for x, _ in batches]) for batches in (seed1, seed2, regrouped)]
    ys = [torch.cat([y for _, y in batches]) for batches in (seed1, seed2, regrouped)]
    assert xs[0].shape == (24, 32)
    assert all(torch.equal(xs[0], x) for x in xs[1:]) and all(torch.equal(ys[0], y) for y in ys[1:])
    assert not torch.equal(seed1[0][0], other.train_batch(0)[0])  # training batches do differ


def test_val_set_size_follows_the_config_and_covers_the_split(small_dataset):
    """n x batch_size distinct windows of real tokens with disjoint targets, spread from the start to
    the end of the val split; asking for more windows than fit is an error that says so."""
    tokens = np.fromfile(small_dataset / "val.bin", dtype=np.uint16)
    batches = TokenBatches(small_dataset, block_size=32, batch_size=4, seed=1)
    for n in (1, 5, 12):
        val = batches.val_batches(n)
        assert len(val) == n and all(x.shape == y.shape == (4, 32) for x, y in val)
        starts = batches.val_windows(4 * n)
        assert len(starts) == 4 * n and (np.diff(starts) >= 32).all()  # targets never overlap
        x = torch.cat([x for x, _ in val]).numpy()
        y = torch.cat([y for _, y in val]).numpy()
        for s, row_x, row_y in zip(starts, x, y, strict=True):
            assert (row_x == tokens[s:s + 32]).all() and (row_y == tokens[s + 1:s + 33]).all()
    available = (len(tokens) - 1) // 32
    assert starts[0] == 0 and starts[-1] > (len(tokens) - 32) * (1 - 2 / 48)  # spread to the end
    every = batches.val_windows(available)
    assert (np.diff(every) == 32).all() and every[-1] + 33 <= len(tokens)
    with pytest.raises(DataError, match="train.eval_iters"):
        batches.val_windows(available + 1)
