"""EUR-Lex token files and batches that depend only on (seed, step) (SPEC §4).

`prepare_dataset` tokenizes a source once into ``<data_root>/<name>/{train,val}.bin`` (uint16 GPT-2
tokens, EOT after every document) plus ``meta.json``; every trial of a sweep memory-maps the same
files. `TokenBatches` draws each training batch from a generator seeded by (seed, step) alone, so
every format sees the same tokens at the same step and a resumed run continues exactly. The
validation set is fixed windows of the val split, the same for every seed, so two trials' val losses
differ only by what they learned, not by which tokens they were scored on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal, Protocol

import filelock
import numpy as np
import tiktoken
import torch
from torch import Tensor

log = logging.getLogger(__name__)

HF_DATASET = ("coastalcph/multi_eurlex", "en")
TOKENIZER = "gpt2"
EOT = 50256
VOCAB_SIZE = 50257
SPLITS = ("train", "val")
_CHUNK_DOCS = 256  # documents tokenized per batch: bounded memory, still multi-threaded
_JSONL_HINT = (
    "data.source=jsonl:DIR with train.jsonl and validation.jsonl files having a 'text' field "
    "(e.g. jsonl:../shared/data/eurlex)"
)

Split = Literal["train", "val"]


class DataError(Exception):
    """A problem the user can fix (offline, missing files, too little data); the message says how."""


class DataSource(Protocol):
    """What `prepare_dataset` reads; `altgrad.config.DataConfig` or any object with these fields."""

    @property
    def source(self) -> str: ...
    @property
    def name(self) -> str | None: ...
    @property
    def max_docs(self) -> int | None: ...
    @property
    def data_root(self) -> str: ...
    @property
    def val_split(self) -> str: ...


def _canonical_source(source: str) -> str:
    """'hf' or 'jsonl:<absolute dir>', so the same data is recognised from any working dir."""
    if source == "hf":
        return source
    if source.startswith("jsonl:") and len(source) > len("jsonl:"):
        return f"jsonl:{Path(source.removeprefix('jsonl:')).expanduser().resolve()}"
    raise DataError(
        f"data.source={source!r} is not a known source. Fix: use 'hf' (downloads "
        f"{HF_DATASET[0]}) or {_JSONL_HINT}"
    )


def _check_request(cfg: DataSource) -> None:
    if cfg.max_docs is not None and (not isinstance(cfg.max_docs, int) or cfg.max_docs < 1):
        raise DataError(f"data.max_docs={cfg.max_docs!r} must be a positive integer or None")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", cfg.val_split) or cfg.val_split == "train":
        raise DataError(
            f"data.val_split={cfg.val_split!r} must name a held-out split such as 'validation' or 'test'"
        )


def dataset_name(cfg: DataSource) -> str:
    """The dataset's directory name: `cfg.name`, or one derived from source, max_docs and val_split."""
    if cfg.name is not None:
        if cfg.name in ("", ".", "..") or Path(cfg.name).name != cfg.name:
            raise DataError(f"data.name={cfg.name!r} must be a plain directory name (no '/')")
        return cfg.name
    source = _canonical_source(cfg.source)
    if source == "hf":
        name = "eurlex-hf"
    else:
        path = source.removeprefix("jsonl:")
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(path).name) or "data"
        name = f"{stem}-jsonl-{hashlib.sha256(path.encode()).hexdigest()[:8]}"
    if cfg.max_docs is not None:
        name += f"-n{cfg.max_docs}"
    if cfg.val_split != "validation":
        name += f"-{cfg.val_split}"
    return name


def dataset_dir(cfg: DataSource) -> Path:
    """Where `prepare_dataset(cfg)` puts the files (data_root is relative to the working dir)."""
    return Path(cfg.data_root).expanduser().resolve() / dataset_name(cfg)


def prepare_dataset(cfg: DataSource) -> Path:
    """Tokenize the source into ``dataset_dir(cfg)`` unless an identical request is already there.

    A dataset matches when meta.json records the same source, max_docs, val_split and tokenizer and
    both .bin files have the recorded size; otherwise (e.g. an explicit `name` with a new max_docs,
    or a truncated file) it is rebuilt in place. Derived names include max_docs, so changing it
    prepares a separate directory. A file lock makes parallel trials prepare once; files are written
    to a temporary name and renamed, meta.json last, so a crash never leaves a dataset that matches.
    """
    _check_request(cfg)
    source = _canonical_source(cfg.source)
    if source != "hf":
        _check_jsonl_dir(Path(source.removeprefix("jsonl:")), cfg.val_split)
    out = dataset_dir(cfg)
    request = {
        "source": source,
        "max_docs": cfg.max_docs,
        "val_split": cfg.val_split,
        "tokenizer": TOKENIZER,
    }
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file on the way, or a place that cannot hold folders (/proc)
        raise DataError(
            f"data.data_root={cfg.data_root!r}: cannot make the folder {out.parent} ({e.strerror}). "
            "Fix: point data.data_root at a folder that can be written"
        ) from None
    with filelock.FileLock(str(out.parent / f"{out.name}.lock")):
        if _is_prepared(out, request):
            log.info("dataset %s is up to date", out)
            return out
        log.info("preparing dataset %s from %s", out, source)
        enc = _encoder()
        names = {"train": "train", "val": cfg.val_split}
        texts = _split_texts(source, names, cfg.max_docs)
        out.mkdir(exist_ok=True)
        (out / "meta.json").unlink(missing_ok=True)
        meta = {**request, "name": out.name, "eot": EOT, "dtype": "uint16"}
        written = {
            split: _write_split(
                out / f"{split}.bin", texts[split], enc, f"split {names[split]!r} of {source}"
            )
            for split in SPLITS
        }
        for i, key in enumerate(("docs", "tokens", "sha256")):
            meta[key] = {split: result[i] for split, result in written.items()}
        _atomic_write_text(out / "meta.json", json.dumps(meta, indent=2) + "\n")
        log.info("prepared %s: %s docs, %s tokens", out, meta["docs"], meta["tokens"])
    return out


def _is_prepared(out: Path, request: dict) -> bool:
    try:
        meta = json.loads((out / "meta.json").read_text())
        return all(meta.get(k) == v for k, v in request.items()) and all(
            (out / f"{s}.bin").stat().st_size == 2 * meta["tokens"][s] for s in SPLITS
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _encoder() -> tiktoken.Encoding:
    try:
        return tiktoken.get_encoding(TOKENIZER)
    except (OSError, ValueError) as e:  # requests' network errors are OSErrors
        cache = os.environ.get("TIKTOKEN_CACHE_DIR")
        raise DataError(
            f"cannot load tiktoken's {TOKENIZER!r} BPE files (TIKTOKEN_CACHE_DIR={cache!r}): {e}. "
            "Fix: set TIKTOKEN_CACHE_DIR to a folder holding them (e.g. ../shared/data/tiktoken_cache) "
            "or connect to the internet once"
        ) from e


def _check_jsonl_dir(root: Path, val_split: str) -> None:
    """Fail before anything is written when the folder or a split file is missing."""
    if not root.is_dir():
        raise DataError(
            f"data.source: jsonl folder {root} does not exist. Fix: point it at {_JSONL_HINT}"
        )
    for split in ("train", val_split):
        if not (root / f"{split}.jsonl").is_file():
            raise DataError(
                f"data.source: {root / f'{split}.jsonl'} is missing. Fix: {_JSONL_HINT}"
            )


def _split_texts(
    source: str, names: dict[str, str], max_docs: int | None
) -> dict[str, Iterable[list[str]]]:
    """Lazily read chunks of document texts per output split; `names` maps it to the source split."""
    if source == "hf":
        return _hf_texts(names, max_docs)
    root = Path(source.removeprefix("jsonl:"))
    return {split: _jsonl_texts(root / f"{name}.jsonl", max_docs) for split, name in names.items()}


def _jsonl_texts(path: Path, max_docs: int | None) -> Iterator[list[str]]:
    chunk: list[str] = []
    docs = 0
    with path.open("rb") as f:  # decoded line by line, so that a byte that is not UTF-8 has its line
        for lineno, line in enumerate(f, 1):
            if max_docs is not None and docs >= max_docs:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start + 1} of the line). "
                    "Fix: save the file as UTF-8"
                ) from None
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e})") from e
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise DataError(
                    f"{path}:{lineno}: no string 'text' field. Fix: every line must be a JSON "
                    'object like {"text": "..."}'
                )
            chunk.append(record["text"])
            docs += 1
            if len(chunk) == _CHUNK_DOCS:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def _offline_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean 'the hub is unreachable' (huggingface_hub uses requests or httpx)."""
    from huggingface_hub.utils import LocalEntryNotFoundError

    errors: list[type[BaseException]] = [ConnectionError, TimeoutError, LocalEntryNotFoundError]
    httpx = sys.modules.get("httpx")
    if httpx is not None:
        errors.append(httpx.TransportError)
    return tuple(errors)


def _hf_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}


def _hf_texts(names: dict[str, str], max_docs: int | None) -> dict[str, Iterable[list[str]]]:
    import datasets  # slow import; only the hf source needs it

    offline = _offline_errors() + ((OSError,) if _hf_offline() else ())
    try:
        splits = datasets.load_dataset(*HF_DATASET)
    except offline as e:
        flag = ", HF_HUB_OFFLINE is set" if _hf_offline() else ""
        raise DataError(
            f"cannot download {HF_DATASET[0]} (offline?{flag}): {e}. Fix: connect to the internet, "
            f"pre-populate the HF_HOME cache where the hub is reachable, or use {_JSONL_HINT}"
        ) from e
    out: dict[str, Iterable[list[str]]] = {}
    for split, name in names.items():
        if name not in splits:
            raise DataError(f"data.val_split={name!r}: {HF_DATASET[0]} has splits {sorted(splits)}")
        ds = splits[name]
        if "text" not in ds.column_names:
            raise DataError(
                f"{HF_DATASET[0]} split {name!r} has no 'text' column ({ds.column_names})"
            )
        if max_docs is not None:
            ds = ds.select(range(min(max_docs, len(ds))))
        out[split] = (batch["text"] for batch in ds.iter(batch_size=_CHUNK_DOCS))
    return out


def _write_split(
    path: Path, chunks: Iterable[list[str]], enc: tiktoken.Encoding, label: str
) -> tuple[int, int, str]:
    """Stream tokens to ``path`` atomically; returns (documents, tokens, sha256 of the file)."""
    tmp = path.with_name(path.name + ".tmp")
    sha = hashlib.sha256()
    docs = tokens = 0
    try:
        with tmp.open("wb") as f:
            for chunk in chunks:
                ids = [
                    np.asarray([*doc, EOT], dtype=np.uint16)
                    for doc in enc.encode_ordinary_batch(chunk)
                ]
                data = np.concatenate(ids).tobytes()
                f.write(data)
                sha.update(data)
                docs += len(chunk)
                tokens += len(data) // 2
            f.flush()
            os.fsync(f.fileno())
        if docs == 0:
            raise DataError(f"{label} has no documents. Fix: add documents or pick another source")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return docs, tokens, sha.hexdigest()


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _stream_seed(split: str, seed: int, index: int) -> int:
    """A 63-bit torch seed per (split, seed, index): independent streams, stable across processes."""
    digest = hashlib.blake2b(f"{split}:{int(seed)}:{int(index)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class TokenBatches:
    """Training batches of random windows, and the fixed validation windows, of a prepared dataset.

    Each training batch comes from its own generator seeded by (seed, step), never from global RNG
    state, so two trials with the same seed see identical batches whatever their format, call order
    or restart point. The validation windows depend on nothing but the val split and their number.
    """

    def __init__(
        self,
        data_dir: Path | str,
        block_size: int,
        batch_size: int,
        seed: int,
        device: str | torch.device = "cpu",
    ) -> None:
        self.data_dir = Path(data_dir)
        meta_path = self.data_dir / "meta.json"
        if not meta_path.is_file():
            raise DataError(
                f"{self.data_dir} is not a prepared dataset (no meta.json). Fix: run prepare_dataset first"
            )
        if block_size < 1 or batch_size < 1:
            raise DataError(f"block_size={block_size} and batch_size={batch_size} must be positive")
        self.meta: dict = json.loads(meta_path.read_text())
        self.block_size, self.batch_size, self.seed = block_size, batch_size, seed
        self.device = torch.device(device)
        self._data = {
            s: np.memmap(self.data_dir / f"{s}.bin", dtype=np.uint16, mode="r") for s in SPLITS
        }
        for split, data in self._data.items():
            if len(data) <= block_size:
                raise DataError(
                    f"block_size={block_size} needs at least {block_size + 1} tokens, but the {split} "
                    f"split of {self.data_dir} has {len(data)}. Fix: lower model.block_size or use "
                    "more documents (data.max_docs, data.source)"
                )

    def num_tokens(self, split: Split) -> int:
        return len(self._data[split])

    def train_batch(self, step: int) -> tuple[Tensor, Tensor]:
        """Inputs x and next-token targets y, int64 (B, T), for this training step."""
        gen = torch.Generator().manual_seed(_stream_seed("train", self.seed, step))
        starts = torch.randint(self.num_tokens("train") - self.block_size, (self.batch_size,), generator=gen)
        return self._windows("train", starts.numpy())

    def val_windows(self, n: int) -> np.ndarray:
        """Start offsets of n validation windows: non-overlapping blocks of block_size targets, spread
        evenly over the whole val split (block k_j = floor(j * available / n)), so the set samples
        every part of the split, is the same for every seed and batch order, and has no duplicates."""
        available = (self.num_tokens("val") - 1) // self.block_size
        if not 1 <= n <= available:
            raise DataError(
                f"the validation set needs {n} windows of {self.block_size} tokens, but the val split of "
                f"{self.data_dir} holds {available} non-overlapping ones. Fix: lower train.eval_iters "
                "or use more validation documents (data.max_docs, data.source)"
            )
        return np.arange(n, dtype=np.int64) * available // n * self.block_size

    def val_batches(self, n: int) -> list[tuple[Tensor, Tensor]]:
        """The validation set: n batches of batch_size fixed windows (`val_windows`), in order."""
        starts = self.val_windows(n * self.batch_size).reshape(n, self.batch_size)
        return [self._windows("val", s) for s in starts]

    def _windows(self, split: Split, starts: np.ndarray) -> tuple[Tensor, Tensor]:
        """Inputs and targets of the windows starting at `starts`, on the device."""
        windows = starts[:, None] + np.arange(self.block_size + 1)
        xy = torch.from_numpy(np.asarray(self._data[split][windows], dtype=np.int64))
        x, y = xy[:, :-1].contiguous(), xy[:, 1:].contiguous()
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(
                self.device, non_blocking=True
            )
        return x.to(self.device), y.to(self.device)
