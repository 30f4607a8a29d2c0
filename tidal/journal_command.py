"""``tidal journal``: what a broker's journal holds and what a broker started on it would do, offline.

    tidal journal runs/tiny/journal                 # the account of every prompt group, and the file's state
    tidal journal runs/tiny/journal --format json   # the same as one JSON object
    tidal journal runs/tiny                         # a run directory: its journal/
    tidal journal                                   # the config's journal: broker.journal.dir or <run_dir>/journal

It reads the log without writing it (a running broker's journal too) and checks what the broker checks at
start: records and their checksums, the earlier files a compaction refers to. Exit code 0 when the
account holds, 1 when it finds a problem (a group accepted or batched twice, a referred file that cannot
be read), 2 when there is no journal at the path. After a ``kill -9`` of the broker, bytes after the last
intact record are expected: the broker cuts them off when it starts again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tidal.errors import ConfigError
from tidal.journal_audit import JournalAudit, audit_journal

USAGE = "[JOURNAL_DIR_OR_FILE] --format text|json"


@dataclass
class JournalOptions:
    format: str = "text"


def audit_lines(a: JournalAudit) -> list[str]:
    fmt = f"format {a.format}, file {a.file_id}" if a.format else "no FORMAT record"
    tail = a.bytes - a.good_bytes
    if not tail:
        tail_text = "nothing after the last record"
    elif a.tail_is_padding:
        tail_text = f"{tail:,} bytes of zero padding after the last record"
    else:
        tail_text = (
            f"{tail:,} bytes after the last intact record that are not a record (a write torn by a crash, "
            "or what a reused file held before); a broker starting on it cuts them off"
        )
    records = ", ".join(f"{n:,} {kind}" for kind, n in sorted(a.records.items())) or "none"
    batches = f"{len(a.batches):,} batches ({a.batches[0]}-{a.batches[-1]})" if a.batches else "0 batches"
    since = " since the compaction (its snapshot's live groups count as accepted)" if a.compacted else ""
    r = a.run
    whole_run = (
        [
            f"  the whole run (the compaction snapshot's counters and what follows): {r['taken']:,} taken, "
            f"{r['accepted']:,} accepted, {r['dropped_stale']:,} dropped as stale, {r['filtered']:,} "
            f"filtered, {r['failed']:,} dropped as failed, {r['batched']:,} in {r['batches']:,} batches"
        ]
        if a.compacted
        else []
    )
    cursor = f"epoch {a.cursor[0]}, position {a.cursor[1]}" if a.cursor else "not moved"
    lines = [
        f"journal {a.path}: {fmt}, {a.bytes:,} bytes, {tail_text}",
        f"  records: {records}"
        + (" (compacted: history before the SNAPSHOT is gone)" if a.compacted else ""),
        f"  groups{since}: {a.taken:,} taken from the prompt source, {a.accepted:,} accepted, "
        f"{a.dropped_stale:,} dropped as stale, {a.filtered:,} filtered, {a.failed:,} dropped as failed, "
        f"{a.batched:,} in {batches}",
        *whole_run,
        f"  trainer: consumed through batch {a.consumed_through}, policy version "
        f"{'none published' if a.policy_version is None else a.policy_version}; "
        f"prompt cursor {cursor}",
        f"  a broker started on it: re-leases {a.outstanding:,} groups that were out on leases"
        + (f" ({a.failing:,} with failed sampling attempts, which it keeps counting)" if a.failing else "")
        + ", keeps "
        f"{a.buffered:,} accepted groups for later batches, serves {a.unconsumed_batches:,} cut batches again",
    ]
    if a.writer:
        lines.append(f"  a broker is writing it now ({a.writer}): this is its state at one moment")
    if a.source:
        order = f"shuffled with seed {a.source['seed']}" if a.source["shuffle"] else "in file order"
        lines.append(
            f"  prompt data: {a.source['rows']:,} rows {order}, digest {a.source['digest']} "
            "(a broker resumes this journal only over these rows)"
        )
    if a.refs:
        state = "unreadable" if a.ref_error else "all read back and checked"
        lines.append(f"  {a.refs:,} groups kept in {len(a.ref_files)} earlier file(s) by compaction: {state}")
    problems = a.problems
    lines += (
        [f"  PROBLEM: {p}" for p in problems]
        if problems
        else ["  ok: no group accepted twice, batched twice or batched unaccepted; batch ids consecutive"]
    )
    return lines


def main(config, args: list[str]) -> int:
    from tidal.trainer.flags import parse_flags

    paths, flags = [], []
    it = iter(args)
    for arg in it:
        if arg.startswith("--"):
            flags.append(arg)
            if "=" not in arg:
                flags.append(next(it, ""))  # its value
        else:
            paths.append(arg)
    opts = parse_flags(flags, JournalOptions(), "tidal journal", USAGE)
    if opts.format not in ("text", "json"):
        raise ConfigError(f"tidal journal: --format={opts.format!r}; use text or json")
    if len(paths) > 1:
        raise ConfigError(f"tidal journal: one journal at a time, got {paths} (usage: tidal journal {USAGE})")
    path = paths[0] if paths else config.journal_dir()
    audit = audit_journal(path)
    if opts.format == "json":
        print(json.dumps(audit.as_dict(), indent=2, sort_keys=True))
    else:
        print("\n".join(audit_lines(audit)))
    return 1 if audit.problems else 0
