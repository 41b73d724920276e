"""`ckptctl inspect checkpoint-N/`: an HF Trainer / accelerate checkpoint folder, its DCP parts each
described as `inspect` describes a checkpoint, and its files: which follow a world-size change.

`--json` prints one document:

    {
      "path": str, "format": "hf-trainer folder",
      "parts": {name: {"kind": "model" | "optimizer", ...inspect's document of the part}},
      "rank_files": [{"kind": str, "files": [name], "ranks": int, "exclude": glob, "shared": bool}],
                                     # one file per process (shared: one file every process loads,
                                     # of `ranks` processes, 0 when not known): kept by a reshard
                                     # to `ranks` only
      "files": [name],               # of no rank: a reshard copies them byte for byte
      "rank_shards": [name],         # use_dcp=False shards: a reshard refuses them
      "others": [name]               # neither a part nor a file: a reshard refuses them
    }
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptctl.cli.common import emit_json, show_rows, stdout, write_line
from ckptctl.cli.inspect_cmd import _print_chunks, _print_problems, _print_summary, _print_tensors, inspect_document
from ckptctl.util.errors import UsageError
from ckptctl.util.wording import counted

if TYPE_CHECKING:
    from ckptctl.storage.trainer_folder import TrainerFolder

FORMAT = "hf-trainer folder"


def folder_document(folder: TrainerFolder, pattern: str | None) -> dict[str, Any]:
    """The folder's `--json` document (schema in the module docstring)."""
    from ckptctl.core.analysis import analysis
    from ckptctl.formats.dcp.metadata import open_checkpoint

    parts = {}
    for name in folder.parts:
        opened = open_checkpoint(folder.path / name)
        parts[name] = {"kind": "model" if name in folder.models else "optimizer",
                       **inspect_document(opened, analysis(opened), pattern)}
    if pattern is not None and not any(part["tensors"] or part["bytes_entries"] for part in parts.values()):
        raise UsageError(f"--filter {pattern!r} matches none of the entries of {', '.join(parts)}")
    return {"path": str(folder.path), "format": FORMAT, "parts": parts,
            "rank_files": [{"kind": r.kind, "files": list(r.names), "ranks": r.ranks, "exclude": r.glob,
                            "shared": r.shared}
                           for r in folder.rank_files],
            "files": list(folder.files), "rank_shards": list(folder.rank_shards), "others": list(folder.others)}


def _part_line(part: dict[str, Any]) -> str:
    return (f"saved world size {part['world_size']}, {counted(len(part['tensors']), 'tensor')}, "
            f"{counted(len(part['bytes_entries']), 'bytes entry', 'bytes entries')}")


def _rank_line(shown: str, r: dict[str, Any]) -> str:
    drop = f"(--exclude '{r['exclude']}' drops it)"
    if r["shared"] and not r["ranks"]:
        return f"{shown}: {r['kind']} (one file every process loads) of a world size not known, kept by no reshard {drop}"
    shared = " (one file every process loads)" if r["shared"] else ""
    return f"{shown}: {r['kind']} of {r['ranks']} ranks{shared}, kept by a reshard to {r['ranks']} ranks only {drop}"


def _rows(doc: dict[str, Any], folder: TrainerFolder) -> list[tuple[str, str]]:
    rank_files = [(state.shown, r) for state, r in zip(folder.rank_files, doc["rank_files"])]
    return [
        ("Checkpoint folder", doc["path"]),
        ("Format", "HF Trainer / accelerate checkpoint folder (FSDP, SHARDED_STATE_DICT)"),
        *((part["kind"].capitalize(), f"{name}: {_part_line(part)}")
          for name, part in doc["parts"].items()),
        *(("Per-rank files", _rank_line(shown, r)) for shown, r in rank_files),
        *((("Other files", f"{', '.join(doc['files'])}: of no rank, copied by a reshard as they are"),)
          if doc["files"] else ()),
        *((("Rank shards", f"{', '.join(doc['rank_shards'])}: saved with use_dcp=False, not resharded"),)
          if doc["rank_shards"] else ()),
        *((("Others", f"{', '.join(doc['others'])}: neither a DCP part nor a file, not resharded"),)
          if doc["others"] else ()),
    ]


def show_folder(folder: TrainerFolder, pattern: str | None, json_out: bool, chunks: bool, check: bool) -> bool:
    """Print the folder as `inspect` asked; True when a part has problems (`--check` exits 1)."""
    doc = folder_document(folder, pattern)
    problems = [(name, p) for name, part in doc["parts"].items() for p in part["problems"]]
    if json_out:
        emit_json(doc)
    elif check:
        for name, p in problems:
            write_line(f"{name}: {p['message']}")
        if not problems:
            write_line(f"ok: {counted(sum(len(p['tensors']) for p in doc['parts'].values()), 'tensor')} complete "
                       f"and consistent in {counted(len(doc['parts']), 'part')}")
    else:
        show_rows(_rows(doc, folder))
        for name, part in doc["parts"].items():
            stdout().print(f"\n{name}", markup=False, highlight=False)
            _print_summary(part)
            _print_tensors(part["tensors"], {p["fqn"]: p["kind"] for p in part["problems"]})
            if chunks:
                _print_chunks(part["tensors"])
            _print_problems(part["problems"])
    return bool(problems)
