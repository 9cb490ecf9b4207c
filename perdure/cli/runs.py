"""`perdure runs scan | ls | show ID | best METRIC [--max] | export FILE`: the run registry on the command line.

Every subcommand takes `--root DIR` (default `$PERDURE_ROOT`, else `./runs`); `ls`, `best` and `export` filter with
`--lineage`, `--status` and `--tag`. Tables go to stdout; a corrupt sidecar is reported on stderr and skipped.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections import Counter
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from perdure.config import flatten
from perdure.safe_io import echo, escape_terminal
from perdure.wording import counted
from perdure.workspace.goodput import RUN_PARTS, format_fraction, is_goodput
from perdure.workspace.registry import Registry, RegistryError, RunRecord
from perdure.workspace.sidecar import SIDECAR_NAME, STALE, STATUSES, parse_stamp, read_sidecar

_EMPTY = "-"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `runs` and its subcommands to the `perdure` command's subparsers."""
    root = argparse.ArgumentParser(add_help=False)
    root.add_argument("--root", help="workspace root (default: $PERDURE_ROOT, else ./runs)")
    filters = argparse.ArgumentParser(add_help=False)
    filters.add_argument("--lineage", help="only runs of this lineage")
    filters.add_argument("--status", choices=(*STATUSES, STALE), help="only runs with this (effective) status")
    filters.add_argument("--tag", help="only runs carrying this tag")

    parser = subparsers.add_parser("runs", help="find, compare and export runs", description=__doc__)
    commands = parser.add_subparsers(dest="runs_command", required=True, metavar="{scan,ls,show,best,export}")

    scan = commands.add_parser("scan", parents=[root], help="refresh registry.db from the sidecars")
    scan.add_argument("--full", action="store_true", help="re-read every sidecar, not only the changed ones")
    scan.set_defaults(handler=cmd_scan)

    ls = commands.add_parser("ls", parents=[root, filters], help="list runs, most recently updated first")
    ls.add_argument("--metric", action="append", help="metric column(s) to show, e.g. val/loss (repeatable)")
    ls.add_argument("-n", "--limit", type=int, help="show at most N runs")
    ls.set_defaults(handler=cmd_ls)

    show = commands.add_parser("show", parents=[root], help="one run in detail: summary, attempts, hparams")
    show.add_argument("id", help="run id, or a unique prefix of it")
    show.set_defaults(handler=cmd_show)

    best = commands.add_parser("best", parents=[root, filters], help="runs ranked by the best value of a metric")
    best.add_argument("metric", help="split/name, e.g. val/loss")
    best.add_argument("--max", action="store_true", help="higher is better (default: lower is better)")
    best.add_argument("-n", "--limit", type=int, default=None, help="show at most N runs")
    best.set_defaults(handler=cmd_best)

    export = commands.add_parser("export", parents=[root, filters], help="write runs to .csv, .json or .parquet")
    export.add_argument("file", help="output file; the format follows the suffix")
    export.set_defaults(handler=cmd_export)
    return parser


# ---------------------------------------------------------------------- handlers


def cmd_scan(args: argparse.Namespace) -> int:
    """`perdure runs scan [--full]`: refresh the cache and say what changed."""
    registry = Registry(args.root)
    report = registry.scan(full=args.full)
    _report_skipped(registry)
    echo(
        f"{report.found} run(s) under {report.root}: {report.updated} read, {report.removed} removed, "
        f"{len(report.errors)} skipped"
    )
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    """`perdure runs ls`: a table of runs, newest update first."""
    registry = Registry(args.root)
    records = registry.runs(lineage=args.lineage, status=args.status, tag=args.tag)
    _report_skipped(registry)
    if args.limit is not None:
        records = records[: max(args.limit, 0)]
    if not records:
        echo(f"no runs under {registry.root}{_filtered(args)}", file=sys.stderr)
        return 0
    metrics = args.metric or _default_metrics(records)
    headers = ["ID", "LINEAGE", "STATUS", "STEP", *metrics, "GOODPUT", "UPDATED"]
    rows = [
        [r.run_id, r.lineage or _EMPTY, r.status, _num(r.step), *(_num(r.metric(m)) for m in metrics)]
        + [_percent(r.goodput), _when(r.updated)]
        for r in records
    ]
    echo(table(headers, rows, right=range(3, 5 + len(metrics))))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    """`perdure runs show ID`: everything the sidecar says about one run."""
    registry = Registry(args.root)
    record = registry.get(args.id)
    _report_skipped(registry)
    data = read_sidecar(record.path / SIDECAR_NAME)
    status = record.status
    if status == STALE:
        status += f" (sidecar says running; last sign of life {_when(data.get('updated'))})"
    elif status == "stuck" and isinstance(data.get("stuck_reason"), str):
        status += f" ({data['stuck_reason']})"
    fields = [
        ("run", record.run_id),
        ("path", str(record.path)),
        ("lineage", record.lineage),
        ("code_id", record.code_id),
        ("config_id", record.config_id),
        ("status", status),
        ("tags", ", ".join(record.tags)),
        ("step", _num(record.step)),
        ("epoch", _num(record.epoch)),
        ("budget", _budget(data["attempts"])),
        ("created", _when(record.created)),
        ("updated", _when(record.updated)),
        ("latest ckpt", record.latest_checkpoint),
        ("best ckpt", record.best_checkpoint),
    ]
    echo(table(["", ""], [[key, _EMPTY if value in (None, "") else str(value)] for key, value in fields], header=False))
    if record.summary:
        echo("\nmetrics")
        rows = [
            [key, *(_num(entry.get(stat)) for stat in ("latest", "latest_step", "min", "min_step", "max", "max_step"))]
            for key, entry in sorted(record.summary.items())
        ]
        echo(table(["METRIC", "LATEST", "@STEP", "MIN", "@STEP", "MAX", "@STEP"], rows, right=range(1, 7)))
    if is_goodput(data.get("goodput")):
        echo(f"\ngoodput {format_fraction(data['goodput'])} of the run's wall time trained the model (kept training)")
        echo(_goodput_table(data["goodput"], data["attempts"]))
    if data["attempts"]:
        echo("\nattempts")
        echo(_attempts_table(data["attempts"]))
        if replicas := _replica_rows(data.get("ft")):
            echo("\nreplica groups (TorchFT)")
            headers = ["REPLICA", "ATTEMPT", "COMMITTED", "UNCOMMITTED", "QUORUM CHANGES", "LAST QUORUM", "HEALS"]
            echo(table(headers, replicas, right=(0, 2, 3, 4)))
        failures = [(i, f) for i, a in enumerate(data["attempts"], start=1) for f in a.get("save_failures") or []]
        if failures:
            echo("\nfailed saves")
            echo(table(["#", "CHECKPOINT", "ERROR"], [[str(i), f["checkpoint"], f["error"]] for i, f in failures]))
    if record.hparams:
        echo("\nhparams")
        params = flatten(record.hparams)
        echo(table(["", ""], [[key, _value(value)] for key, value in params.items()], header=False, indent=2))
    return 0


def cmd_best(args: argparse.Namespace) -> int:
    """`perdure runs best METRIC [--max]`: runs ranked by the best value they reached."""
    registry = Registry(args.root)
    ranked = registry.best(
        args.metric, maximize=args.max, lineage=args.lineage, status=args.status, tag=args.tag, limit=args.limit
    )
    _report_skipped(registry)
    if not ranked:
        known = registry.metrics()
        if args.metric not in known:
            close = difflib.get_close_matches(args.metric, known, n=5, cutoff=0.5) or known
            hint = f"known metrics: {', '.join(close[:10])}" if close else "no run has logged metrics yet"
            raise RegistryError(f"no run under {registry.root} has metric '{args.metric}'; {hint}")
        echo(f"no runs with '{args.metric}'{_filtered(args)}", file=sys.stderr)
        return 0
    stat = "max" if args.max else "min"
    headers = ["#", "ID", "LINEAGE", "STATUS", f"{args.metric} ({stat})", "@STEP", "UPDATED"]
    rows = [
        [str(rank), r.run_id, r.lineage or _EMPTY, r.status, _num(value), _num(r.metric(args.metric, f"{stat}_step"))]
        + [_when(r.updated)]
        for rank, (r, value) in enumerate(ranked, start=1)
    ]
    echo(table(headers, rows, right=(0, 4, 5)))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """`perdure runs export FILE.{csv,json,parquet}`."""
    registry = Registry(args.root)
    filters = {"lineage": args.lineage, "status": args.status, "tag": args.tag}
    path = registry.export(args.file, **filters)
    _report_skipped(registry)
    echo(f"wrote {len(registry.runs(**filters))} run(s) to {path}")
    return 0


# ---------------------------------------------------------------------- formatting


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    right: Sequence[int] | range = (),
    header: bool = True,
    indent: int = 0,
) -> str:
    """Aligned columns separated by two spaces; columns in `right` are right-aligned (numbers). Control characters
    (terminal escapes, CR, tabs, newlines) in any cell are shown escaped, never sent to the terminal."""
    lines = [[escape_terminal(cell) for cell in headers]] if header else []
    lines += [[escape_terminal(cell) for cell in row] for row in rows]  # every value may come from a sidecar
    widths = [max(len(line[i]) for line in lines) for i in range(len(headers))]
    to_right = set(right)
    out = []
    for line in lines:
        cells = [cell.rjust(w) if i in to_right else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths))]
        out.append((" " * indent + "  ".join(cells)).rstrip())
    return "\n".join(out)


def _replica_rows(ft: Any) -> list[list[str]]:
    """One row per replica group of a TorchFT run's sidecar (`ft.replicas`), read as data from someone else."""
    replicas = ft.get("replicas") if isinstance(ft, dict) else None
    if not isinstance(replicas, dict):
        return []
    rows = []
    for key, record in sorted(replicas.items(), key=lambda item: str(item[0]).zfill(8)):
        if not isinstance(record, dict):
            continue
        changes = [c for c in record.get("quorum_changes") or [] if isinstance(c, dict)]
        heals = [h for h in record.get("heals") or [] if isinstance(h, dict)]
        last = changes[-1] if changes else {}
        quorum = f"{_num(last.get('participants'))} group(s) at step {_num(last.get('step'))}" if last else _EMPTY
        healed = _EMPTY
        if heals:
            h = heals[-1]
            steps = f"{_num(h.get('from_step'))}->{_num(h.get('to_step'))}"
            healed = f"{len(heals)}; last {steps} in {_num(h.get('seconds'))}s"
        rows.append(
            [str(key), _when(record.get("attempt")), _num(record.get("steps_committed")),
             _num(record.get("steps_uncommitted")), str(len(changes)), quorum, healed]
        )  # fmt: skip
    return rows


def _budget(attempts: Sequence[dict[str, Any]]) -> str | None:
    """The budget the newest attempt that recorded one ran with: `300 steps`, `1 epoch`."""
    for attempt in reversed(attempts):
        budget = attempt.get("budget")
        if isinstance(budget, dict) and len(budget) == 1:
            ((unit, size),) = budget.items()
            if unit in ("steps", "epochs") and isinstance(size, int) and not isinstance(size, bool):
                return counted(size, unit[:-1])
    return None


def _goodput_table(run: dict[str, Any], attempts: Sequence[dict[str, Any]]) -> str:
    """Seconds per goodput part: the run's, then each attempt's (`-` for an attempt recorded without one)."""
    numbered = [(index, attempt.get("goodput")) for index, attempt in enumerate(attempts, start=1)]
    headers = ["PART", "RUN S", "%", *(f"#{index} S" for index, _ in numbered)]
    wall = sum(run["seconds"].values())
    rows = []
    for part in RUN_PARTS:
        seconds = run["seconds"].get(part, 0.0)
        share = f"{100 * seconds / wall:.1f}" if wall > 0 else _EMPTY
        each = [_seconds(g["seconds"].get(part)) if is_goodput(g) else _EMPTY for _, g in numbered]
        rows.append([part, _seconds(seconds), share, *each])
    total = [_seconds(sum(g["seconds"].values())) if is_goodput(g) else _EMPTY for _, g in numbered]
    rows.append(["wall", _seconds(wall), "100.0", *total])
    return table(headers, rows, right=range(1, len(headers)))


def _seconds(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else _EMPTY


def _percent(fraction: float | None) -> str:
    return _EMPTY if fraction is None else f"{100 * fraction:.1f}%"


def _attempts_table(attempts: Sequence[dict[str, Any]]) -> str:
    headers = ["#", "STARTED", "ENDED", "STATUS", "FROM STEP", "DONE", "LOST", "SAVE S", "RESTARTS", "EXIT"]
    replicas = any("replica" in attempt for attempt in attempts)
    if replicas:  # a TorchFT run: which replica group each attempt was
        headers.insert(1, "REPLICA")
    rows = []
    for index, attempt in enumerate(attempts, start=1):
        restarts = ",".join(f"{k}={v}" for k, v in (attempt.get("restart_counts") or {}).items() if v is not None)
        rows.append(
            [
                str(index),
                *([_num(attempt.get("replica"))] if replicas else []),
                _when(attempt.get("started")),
                _when(attempt.get("ended")),
                str(attempt.get("status") or _EMPTY),
                _num(attempt.get("resumed_step")),
                _num(attempt.get("steps_done")),
                _num(attempt.get("steps_lost")),
                _num(attempt.get("save_seconds")),
                restarts or _EMPTY,
                str(attempt.get("exit_reason") or _EMPTY),
            ]
        )
    shift = 1 if replicas else 0
    return table(headers, rows, right=(0, 4 + shift, 5 + shift, 6 + shift, 7 + shift))


def _default_metrics(records: Sequence[RunRecord]) -> list[str]:
    """Up to two metric columns: the score metric most runs use (`score.split/score.metric`), then `train/loss`,
    then the most common metrics."""
    counts: Counter[str] = Counter()
    scores: Counter[str] = Counter()
    for record in records:
        counts.update(list(record.summary))
        score = record.hparams.get("score") or {}
        key = f"{score.get('split')}/{score.get('metric')}"
        if key in record.summary:
            scores[key] += 1
    picks = [key for key, _ in scores.most_common(1)]
    for key in ["train/loss", *(key for key, _ in counts.most_common())]:
        if key in counts and key not in picks:
            picks.append(key)
    return picks[:2]


def _num(value: Any) -> str:
    if value is None:
        return _EMPTY
    if isinstance(value, float):
        return f"{value:.5g}"
    return str(value)


def _value(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _when(stamp: Any) -> str:
    """A sidecar stamp as `YYYY-MM-DD HH:MM:SS` (UTC)."""
    if not stamp:
        return _EMPTY
    seconds = parse_stamp(str(stamp))
    if seconds is None:
        return str(stamp)
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _filtered(args: argparse.Namespace) -> str:
    given = [f"--{name} {getattr(args, name)}" for name in ("lineage", "status", "tag") if getattr(args, name, None)]
    return f" matching {' '.join(given)}" if given else ""


def _report_skipped(registry: Registry) -> None:
    for issue in registry.last_scan.errors if registry.last_scan else []:
        echo(f"warning: skipped {issue.path}: {issue.reason}", file=sys.stderr)
