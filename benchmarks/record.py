"""Benchmark results as committed files, and the README's performance table rendered from them.

Each benchmark script takes `--record [DIR]`: it then writes what it measured, as claims (a ratio
against a baseline of the same run, and the target it must meet), to `DIR/<name>.json` (default
`benchmarks/results/`) with the date, the commit and the machine. `make bench` runs every script
that way and then this one, which rewrites the table between the README's
`<!-- bench:begin -->` / `<!-- bench:end -->` markers:

    python benchmarks/record.py [--readme README.md] [--results benchmarks/results]

so every number in that table is one a committed file holds, never one typed by hand.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from altgrad.provenance import source_commit

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


@dataclass(frozen=True)
class Claim:
    """One measured ratio: `what` took `ratio` x `baseline`'s time in the same run; must be <= `target`."""

    what: str
    ratio: float
    baseline: str
    target: float
    detail: str = ""  # the absolute numbers behind the ratio, e.g. "145 vs 186 ms"

    @property
    def met(self) -> bool:
        return self.ratio <= self.target


@dataclass(frozen=True)
class Result:
    """What one benchmark run measured, and where: the content of one results file."""

    name: str
    command: str
    date: str
    commit: str
    machine: str
    claims: tuple[Claim, ...]


def machine() -> str:
    """The hardware a number was measured on, as a reader needs it to compare numbers."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (CUDA), torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        models = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")]
        cpu = models[0] if models else cpu
    except OSError:
        pass
    return (f"{os.cpu_count()}-core {cpu}, {torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}")


def write(name: str, claims: list[Claim], directory: Path = RESULTS_DIR) -> Path:
    """Record a run's claims as `directory/<name>.json`; the command is this process's own."""
    result = Result(name=name, command=" ".join(["python", *sys.argv]), date=datetime.date.today().isoformat(),
                    commit=source_commit() or "unknown", machine=machine(), claims=tuple(claims))
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps(asdict(result), indent=1) + "\n")
    return path


def read_all(directory: Path = RESULTS_DIR) -> list[Result]:
    results = []
    for path in sorted(directory.glob("*.json")):
        raw = json.loads(path.read_text())
        raw["claims"] = tuple(Claim(**c) for c in raw["claims"])
        results.append(Result(**raw))
    return results


def table(results: list[Result]) -> str:
    """The README's performance table: one row per claim, with the run it came from."""
    rows = ["| benchmark (run) | what | measured | target |", "|---|---|---|---|"]
    for result in results:
        run = f"`{result.command.removeprefix('python ')}`<br>{result.date}, {result.commit}, {result.machine}"
        for i, claim in enumerate(result.claims):
            detail = f" ({claim.detail})" if claim.detail else ""
            verdict = "met" if claim.met else "**missed**"
            rows.append(f"| {run if i == 0 else ''} | {claim.what} vs {claim.baseline} | "
                        f"{claim.ratio:.2f}x{detail} | <= {claim.target}x: {verdict} |")
    return "\n".join(rows)


def publish(readme: Path, results: list[Result]) -> None:
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme} has no {BEGIN} ... {END} block to write the table into")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{table(results)}\n{END}{tail}")


def add_record_argument(parser: argparse.ArgumentParser) -> None:
    """`--record [DIR]` for a benchmark script: write its claims to DIR (default benchmarks/results)."""
    parser.add_argument("--record", nargs="?", const=RESULTS_DIR, type=Path, metavar="DIR",
                        help="write the claims to DIR/<name>.json (default: benchmarks/results)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", type=Path, default=Path(__file__).resolve().parents[1] / "README.md")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    results = read_all(args.results)
    if not results:
        print(f"no results in {args.results}: run `make bench` first", file=sys.stderr)
        return 2
    publish(args.readme, results)
    print(f"{args.readme}: performance table from {len(results)} results file(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
