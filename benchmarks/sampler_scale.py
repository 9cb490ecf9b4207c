"""Sampler at scale: what an epoch start and a resume cost at 10M and 100M samples, in time and in memory.

Each case runs in a fresh process (so its peak RSS is its own): build the sampler for a dataset of N samples, then
either start an epoch (`set_epoch(e)`, `iter`, the first 64 indices) or resume one (`set_epoch(e, offset)` at 73% of
the epoch, `iter`, the first 64 indices), and report the wall time of that and the growth of the peak RSS over the
process's peak before it. Then it reads 1M indices on, for the per-index cost of iterating.

Implementations compared in the same run:
  list        perdure's sampler before: `torch.randperm(n).tolist()` per epoch (the baseline; 10M only by default,
              at 100M it needs ~4 GiB: `--list-at-100m`)
  randperm    the same permutation kept as an int32 tensor and sliced (what perdure does up to 4M samples)
  perdure     perdure's ResumableSampler as it is: randperm up to `RANDPERM_LIMIT`, the hashed bijection above

    python benchmarks/sampler_scale.py [--list-at-100m]
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time

from _common import format_table, format_targets, load_note, setup_threads, target, write_results

NAME = "sampler_scale"
SEED = 0
EPOCH = 3
FIRST = 64
READ = 1_000_000
TARGET_SECONDS = 0.25  # "well under a second"
TARGET_MIB = 25.0  # "well under 100 MB"


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class ListSampler:
    """The sampler perdure had before: the epoch's whole order as a Python list."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = self.offset = 0

    def set_epoch(self, epoch: int, offset: int = 0) -> None:
        self.epoch, self.offset = epoch, offset

    def __iter__(self):
        import torch

        generator = torch.Generator()
        generator.manual_seed(SEED + self.epoch)
        order = torch.randperm(self.n, generator=generator).tolist()
        return iter(order[self.offset :])


class TensorSampler(ListSampler):
    """The same permutation as one int32 tensor, sliced at the offset and read in chunks."""

    def __iter__(self):
        import torch

        generator = torch.Generator()
        generator.manual_seed(SEED + self.epoch)
        order = torch.randperm(self.n, generator=generator, dtype=torch.int32)
        return (index for chunk in order[self.offset :].split(1 << 16) for index in chunk.tolist())


def run_case(implementation: str, n: int, action: str) -> dict[str, float]:
    import torch

    from perdure.data.sampler import ResumableSampler

    # torch's first operations load kernels and allocator pools: pay that before the baseline RSS is taken
    generator = torch.Generator()
    generator.manual_seed(SEED)
    ((torch.randperm(1 << 16, generator=generator, dtype=torch.int32)[::3].long() % 7) >> 1).tolist()

    if implementation == "list":
        sampler = ListSampler(n)
    elif implementation == "randperm":
        sampler = TensorSampler(n)
    else:
        sampler = ResumableSampler(n, seed=SEED)
    offset = int(n * 0.73) if action == "resume" else 0
    before = peak_rss_mib()
    started = time.perf_counter()
    sampler.set_epoch(EPOCH, offset)
    iterator = iter(sampler)
    first = [next(iterator) for _ in range(FIRST)]
    seconds = time.perf_counter() - started
    grown = peak_rss_mib() - before
    started = time.perf_counter()
    count = 0
    for _ in iterator:
        count += 1
        if count == READ:
            break
    per_index_ns = (time.perf_counter() - started) / max(count, 1) * 1e9
    assert len(set(first)) == FIRST and all(0 <= index < n for index in first)
    return {"seconds": seconds, "rss_mib": grown, "ns_per_index": per_index_ns}


def measure(cases: list[tuple[str, int, str]]) -> list[dict]:
    results = []
    for implementation, n, action in cases:
        command = [sys.executable, __file__, "--case", f"{implementation}:{n}:{action}"]
        output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        record = {"implementation": implementation, "n": n, "action": action, **json.loads(output)}
        print(f"{implementation:>8} n={n:>11,} {action:<6} {record['seconds']:.3f}s +{record['rss_mib']:.0f} MiB "
              f"{record['ns_per_index']:.0f} ns/index", flush=True)  # fmt: skip
        results.append(record)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--list-at-100m", action="store_true", help="also time the old list sampler at 100M")
    args = parser.parse_args(argv)
    threads = setup_threads()
    if args.case:
        implementation, n, action = args.case.split(":")
        print(json.dumps(run_case(implementation, int(n), action)))
        return 0
    cases = [(impl, 10_000_000, action) for impl in ("list", "randperm", "perdure") for action in ("start", "resume")]
    big = ["randperm", "perdure"] + (["list"] if args.list_at_100m else [])
    cases += [(impl, 100_000_000, action) for impl in big for action in ("start", "resume")]
    print(f"{NAME}: one process per case, torch threads {threads}", flush=True)
    results = measure(cases)
    by = {(r["implementation"], r["n"], r["action"]): r for r in results}
    rows = [
        [r["implementation"], f"{r['n']:,}", r["action"], r["seconds"], r["rss_mib"], r["ns_per_index"]]
        for r in results
    ]
    print(format_table(["sampler", "samples", "epoch", "seconds", "+peak RSS MiB", "ns/index read"], rows))
    list_resume = by[("list", 10_000_000, "resume")]
    new_resume = by[("perdure", 10_000_000, "resume")]
    ratios = {
        "list / perdure, resume seconds at 10M": list_resume["seconds"] / max(new_resume["seconds"], 1e-9),
        "list / perdure, resume +RSS at 10M": list_resume["rss_mib"] / max(new_resume["rss_mib"], 1.0),
    }
    for name, value in ratios.items():
        print(f"{name}: {value:.1f}x")
    targets = []
    for action in ("start", "resume"):
        record = by[("perdure", 100_000_000, action)]
        targets.append(target(f"perdure 100M epoch {action}, seconds", record["seconds"], "<=", TARGET_SECONDS))
        targets.append(target(f"perdure 100M epoch {action}, +peak RSS MiB", record["rss_mib"], "<=", TARGET_MIB))
    print(format_targets(targets))
    if note := load_note():
        print(f"WARNING: {note}")
    config = {
        "seed": SEED,
        "epoch": EPOCH,
        "resume_offset": "73% of the epoch",
        "first_indices": FIRST,
        "indices_read_after": READ,
        "torch_threads": threads,
        "measure": "wall seconds of set_epoch + iter + the first 64 indices; growth of the process's peak RSS",
    }
    path = write_results(NAME, config, {"cases": results, "ratios": ratios}, targets)
    print(f"results: {path}")
    return 0 if math.isfinite(results[0]["seconds"]) else 1


if __name__ == "__main__":
    sys.exit(main())
