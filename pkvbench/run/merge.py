"""``pkvbench merge``: the shards of one run (``--shard i/n``) combined into one new run folder."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pkvbench.errors import PkvError
from pkvbench.reports.summary import summarize
from pkvbench.store.lock import FolderLock
from pkvbench.store.results import (
    RUN,
    ResultStore,
    Row,
    comparable_options,
    differing_keys,
    missing_shards,
    read_rows,
    read_run_record,
    row_key,
    shards_held,
    version_changes,
)


def _check_merge_target(out: Path, folders: list[Path]) -> None:
    """``--out`` is a new (or empty) folder that is none of the inputs and holds none of them."""
    target = out.resolve()
    for folder in folders:
        source = folder.resolve()
        if target == source or target in source.parents:
            relation = "is" if target == source else "contains"
            raise PkvError(f"--out {out} {relation} the input {folder}; merge into a new folder")
    if out.is_dir() and any(out.iterdir()):
        raise PkvError(f"--out {out} is not empty; merge writes a new folder and leaves existing ones alone")


def _split(sources: list[Path], records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What a merge of ``sources`` holds of their split: ``{count, merged, missing}``; None where one of them is a
    whole run (or none is a shard). Shards of splits into different counts are refused: they take other samples."""
    first, covered, whole = None, set(), False
    for folder, record in zip(sources, records):
        held = shards_held(folder, record)
        if held is None:
            whole = True
            continue
        if first is not None and held[0] != first[1]:
            raise PkvError(
                f"{folder} is a shard of a split into {held[0]}, {first[0]} of one into {first[1]}: shards of two "
                "splits take other samples; merge the shards of one split"
            )
        first = first or (folder, held[0])
        covered |= held[1]
    if first is None or whole:
        return None
    count = first[1]
    return {"count": count, "merged": sorted(covered), "missing": sorted(set(range(1, count + 1)) - covered)}


def merge_runs(folders: list[str | os.PathLike], out: str | os.PathLike) -> tuple[int, int, str | None]:
    """Combine run folders (typically the shards of one run) into the new folder ``out``; returns (rows written,
    duplicates dropped, the shards missing: ``missing_shards``).

    The folders must come from the same run options, shard aside, and no run may be writing them; shards must be of
    one split (``1/2`` with ``3/3`` is refused), and the shards a merge lacks are recorded in its ``run.json``
    (``shards``: count, merged, missing) and said. A key present in two folders is kept once; if the two rows
    disagree on the prediction the merge is refused, since that means the runs were not the same. A merge that
    fails leaves no files in ``out``.
    """
    out, sources = Path(out), [Path(f) for f in folders]
    _check_merge_target(out, sources)
    records = []
    for folder in sources:
        holder = FolderLock(folder).holder()
        if holder:
            raise PkvError(f"{folder} is being written by a running pkvbench ({holder}); merge it once that run ends")
        if not (folder / RUN).is_file():
            raise PkvError(f"{folder} is not a run folder (no {RUN})")
        records.append(read_run_record(folder / RUN))

    def unsharded(options: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in comparable_options(options).items() if k != "shard"}

    base = unsharded(records[0]["options"])
    for folder, record in zip(sources, records):
        changed = differing_keys(base, unsharded(record["options"]))
        if changed:
            raise PkvError(f"{folder} was run with other options than {sources[0]} ({', '.join(changed)} differ)")
        decisive = version_changes(records[0], record)[0]
        if decisive:
            raise PkvError(f"{folder} was run under other versions than {sources[0]} ({', '.join(decisive)})")
    split = _split(sources, records)
    merged: dict[tuple, Row] = {}
    duplicates = 0
    for folder in sources:
        for row in read_rows(folder):
            key = row_key(row)
            if key in merged:
                if (merged[key].get("pred"), merged[key]["score"]) != (row.get("pred"), row["score"]):
                    raise PkvError(f"{folder}: row {key} disagrees with an earlier folder's; not merging")
                duplicates += 1
                continue
            merged[key] = row
    options = {k: v for k, v in records[0]["options"].items() if k != "shard"}
    with ResultStore(out).claim(options) as store:
        if not store.is_empty():  # checked again under the lock: another merge may have filled it meanwhile
            raise PkvError(f"--out {out} is not empty; merge writes a new folder and leaves existing ones alone")
        try:
            record = {**records[0], "options": options, "merged_from": [str(f) for f in sources]}
            record.pop("shards", None)  # an input's: this merge's own, if any, below
            store.record({**record, **({"shards": split} if split else {})})
            store.extend(list(merged.values()))
            store.write_summary(summarize(store.rows()))
        except BaseException:
            store.discard()
            raise
    return len(merged), duplicates, missing_shards({"shards": split})
