"""`ckptctl inspect CKPT`: what a checkpoint holds, how it is sharded, and whether it is whole.

Reads `.metadata` and file sizes (never tensor bytes), Megatron's training `args` where a
checkpoint has them, and the first 512 bytes of each tensor's first item (which name the class
it pickles: an FP8 training subclass is decoded and shown), so it is quick on any size.
`--check` prints only the problems `ckptctl.core.analysis.analyze` finds (coverage gaps or
overlaps, lost optimizer state), one per line, and exits 1 if there are any; with `--json`
it prints the document as usual and exits 1 the same way. Data files that no entry points
to (another save's leftovers in the same directory) are a warning, not a problem: loading
ignores them.

`--json` prints one document (values exact, sizes in bytes):

    {
      "path": str, "version": str | null, "world_size": int,   # ranks that wrote data files
      "format": "dcp" | "megatron-core torch_dist" | "megatron-fsdp fsdp_dtensor",
                                    # torch_dist: a metadata.json says so; fsdp_dtensor: args.ckpt_format
      "megatron_core": null | {"versions": "0.15 or older" | "0.18 or older" | "0.19 or newer",
                               "evidence": str},              # torch_dist: which releases save so
      "optimizer_format": null | "fully_reshardable" | "fully_sharded_model_space" | "dp_reshardable",
                                                              # torch_dist's DistributedOptimizer format
      "training": null | {"from": "args entry" | "common.pt" | "common_state/shard_0_1",
                          "tp", "pp", "vpp", "dp", "ep", "etp", "cp", "iteration": int | null,
                          "first_stage_layers", "last_stage_layers": int | null,  # an uneven split
                          "pipeline_layout": str | null,                         # a custom one
                          "problem": str | null},          # Megatron's saved args, never executed
      "metadata_files": [".metadata"] | ["__0.metadata", ...],
      "total_bytes": int, "files": {name: bytes},              # every data file, in rank order
      "unreferenced_files": [name],                           # data files no entry points to
      "rank_state": [{"kind": str, "entries": [fqn], "dp": int}],  # per-DP-rank training state:
                                                              # kept by a reshard at the same DP only
                    # Megatron's RNG state also: "grid": [[pp, tp]] (the ranks saved), "dp": DP
                    # states per (pp, tp) rank (1: shared by all; null: unknown), "loader": str
                    # (what Megatron-LM's load_checkpoint does at another DP, TP or PP)
      "groups": {"model": n, "optimizer": n, "other": n},     # all entries, tensors and bytes
      "dtypes": {"float32": n, ...},                          # tensors per dtype
      "layouts": {"shard0-even": n, ...},                     # tensors per layout label
      "prefixes": {"model": ["model.module."], "optimizer": ["optimizer.state.module."]},
      "adapters": null | {"kind": "peft-lora" | "peft-dora"   # peft's
                                  | "megatron-bridge-lora" | "megatron-bridge-canonical-lora",
                          "adapters": [name],                  # peft's adapter names (Bridge's: [])
                          "modules": int, "ranks": [int],      # Bridge's: per layer; its dims
                          "targets": {leaf name: modules},     # Bridge's: its target_modules names
                          "modules_to_save": [module],         # modules peft trains whole
                          "alpha": float | null,               # Bridge's: peft.alpha of its run_config.yaml
                          "run_config": path | null,           # Bridge's: that file, where the checkpoint has one
                          "run_config_problem": str},          # Bridge's: why it could not be read (if so)
      "subclasses": {fqn: str},   # tensors whose (first) item holds an FP8 training subclass:
                                  # torchao's WeightWithDynamicFloat8CastTensor (its value the plain
                                  # tensor it wraps) or Transformer Engine's Float8Tensor (FP8 data +
                                  # scale_inv, its metadata dtype the logical one); filtered too
      "tensors": {fqn: {
          "shape": [int], "dtype": "bfloat16", "nbytes": int,
          "group": "model" | "optimizer" | "other",
          "layout": "scalar" | "empty" | "flat" | "single" | "shard0-even" | "rows-uneven"
                    | "shard1" | "grid" | "tp-dp-grid" | "layer-stacked" | "bucketed" | "model-space"
                    | "irregular",
          "dim1_parts": int | null,                           # column blocks of shard1, grid, tp-dp-grid
          "tp_degree": int | null,                            # tp-dp-grid: a RowParallel weight's TP
          "param": model fqn | null,
          "coverage": {"status": "complete" | "gaps" | "overlaps" | "gaps+overlaps",
                       "covered": int, "gaps": int, "overlaps": int},
          "chunks": [{"file", "offset", "length", "offsets": [int], "sizes": [int],
                      "transforms": [str]}]}},
      "bytes_entries": {fqn: {"file", "offset", "length", "transforms": [str]}},
      "problems": [{"fqn", "kind": "gaps" | "overlaps" | "data-loss" | "shape-mismatch",
                    "message"}]
    }

`--filter GLOB` restricts `tensors`, `bytes_entries`, `problems` (and `--check`) to matching
FQNs; the summary counts always describe the whole checkpoint.
"""

from __future__ import annotations

import fnmatch
import functools
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from ckptctl.cli import app
from ckptctl.cli.common import (
    FILES_LISTED, Fragment, Streamed, emit_json, file_lines, fold_name, human_bytes, json_scalar, run_guarded,
    show_rows, stdout, write_line, write_out,
)
from ckptctl.util.errors import CheckpointError, UsageError
from ckptctl.util.wording import counted

if TYPE_CHECKING:  # the library is imported when the command runs: `ckptctl --help` stays quick
    from ckptctl.formats.megatron_args import TrainingArgs
    from ckptctl.core.analysis import Analysis, TensorReport
    from ckptctl.core.checkpoint import Checkpoint, Chunk

EXIT_PROBLEMS = 1


_CHUNKS_PER_PIECE = 1024
"""Chunk records joined into one piece of text (a tensor of a million chunks is never one string)."""


class _Chunks(Fragment):
    """A tensor's chunks in the document: a record each for `--chunks`' lines (iterated), their
    JSON text for `--json` (`_chunk_records`)."""

    __slots__ = ("chunks",)

    def __init__(self, chunks: Sequence[Chunk]) -> None:
        super().__init__(functools.partial(_chunk_records, chunks))
        self.chunks = chunks

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return ({"file": c.file, "offset": c.offset, "length": c.length, "offsets": list(c.offsets),
                 "sizes": list(c.sizes), "transforms": list(c.transforms)} for c in self.chunks)


def _chunk_records(chunks: Sequence[Chunk], level: int) -> Iterator[str]:
    """A tensor's `chunks` list as `json.dumps(..., indent=2)` writes it at `level`: one record per
    chunk, {"file", "offset", "length", "offsets", "sizes", "transforms"}. Millions of chunks
    make most of a large document; each box tuple's and name's text is made once (chunks share them)."""
    if not chunks:
        yield "[]"
        return
    item, field, number, close = ("\n" + "  " * (level + k) for k in (1, 2, 3, 0))
    texts: dict[Any, str] = {}

    def listed(values: tuple) -> str:
        text = texts.get(values)
        if text is None:
            text = texts[values] = ("[" + number + ("," + number).join(map(json_scalar, values)) + field + "]"
                                    if values else "[]")
        return text

    names: dict[str, str] = {}
    pieces, sep = [], "[" + item
    for c in chunks:
        name = names.get(c.file) or names.setdefault(c.file, json_scalar(c.file))
        pieces.append(f'{sep}{{{field}"file": {name},{field}"offset": {c.offset},{field}"length": {c.length},'
                      f'{field}"offsets": {listed(c.offsets)},{field}"sizes": {listed(c.sizes)},'
                      f'{field}"transforms": {listed(tuple(c.transforms))}{item}}}')
        sep = "," + item
        if len(pieces) >= _CHUNKS_PER_PIECE:
            yield "".join(pieces)
            pieces.clear()
    yield "".join(pieces) + close + "]"


def shown_layout(report: TensorReport) -> str:
    """The layout label inspect shows: a dim-1 split (`shard1`, `grid`) of a weight the Megatron
    rules call RowParallel (its own name or, for an optimizer state, its param's) is
    `tp-dp-grid`, its column blocks the TP degree; a split of any other tensor (FSDP
    `Shard(1)`, expert-parallel experts) keeps its geometric label."""
    if report.layout not in ("shard1", "grid"):
        return report.layout
    from ckptctl.families.registry import parallel_dim  # the family tables: only for checkpoints with such splits

    return "tp-dp-grid" if parallel_dim(report.param or report.fqn) == 1 else report.layout


def _tensor_doc(ckpt: Checkpoint, report: TensorReport) -> dict[str, Any]:
    entry = ckpt.tensors[report.fqn]
    cov = report.coverage
    layout = shown_layout(report)
    return {
        "shape": list(entry.shape), "dtype": entry.dtype_name, "nbytes": entry.nbytes,
        "group": report.group, "layout": layout, "dim1_parts": report.dim1_parts,
        "tp_degree": report.dim1_parts if layout == "tp-dp-grid" else None, "param": report.param,
        "coverage": {"status": cov.status, "covered": cov.covered, "gaps": cov.gaps, "overlaps": cov.overlaps},
        "chunks": _Chunks(entry.chunks),
    }


def inspect_document(ckpt: Checkpoint, analysis: Analysis, pattern: str | None = None) -> dict[str, Any]:
    """The `--json` document (schema in the module docstring); its tensors, chunks and all,
    are made as they are written or shown (`Streamed`), never all at once."""
    keep = (lambda fqn: True) if pattern is None else (lambda fqn: fnmatch.fnmatchcase(fqn, pattern))
    from ckptctl.core.rank_state import MEGATRON_RNG, megatron_rng, rank_states
    from ckptctl.families.adapters import adapter_summary
    from ckptctl.families.bridge_adapters import bridge_adapter_summary
    from ckptctl.families.base import is_model_key
    from ckptctl.formats.megatron_args import training_args

    reports = analysis.reports
    training = training_args(ckpt)
    model_shapes = {fqn: e.shape for fqn, e in ckpt.tensors.items() if is_model_key(fqn)}
    return {
        "path": str(ckpt.path),
        "format": _format(ckpt, training),
        "megatron_core": _megatron_core_doc(ckpt),
        "optimizer_format": analysis.optimizer_format,
        "training": _training_doc(training),
        "version": ckpt.version,
        "world_size": analysis.world_size,
        "metadata_files": list(ckpt.metadata_files),
        "total_bytes": ckpt.total_bytes,
        "files": dict(ckpt.files),
        "unreferenced_files": list(ckpt.unreferenced_files),
        "rank_state": [*({"kind": r.kind, "entries": list(r.fqns), "dp": r.ranks}
                         for r in rank_states(ckpt.bytes_entries)),
                       *({"kind": MEGATRON_RNG, "entries": list(r.fqns), "dp": r.dp, "grid": [list(g) for g in r.grid],
                          "loader": r.loader}
                         for r in [megatron_rng([*ckpt.tensors, *ckpt.bytes_entries],
                                                training.get if training is not None else None)] if r is not None)],
        "groups": analysis.groups,
        "dtypes": analysis.dtypes,
        "layouts": dict(sorted(Counter(shown_layout(r) for r in reports).items())),
        "prefixes": {"model": list(analysis.prefixes.model), "optimizer": list(analysis.prefixes.optimizer)},
        "adapters": adapter_summary(model_shapes) or _with_run_config(ckpt, bridge_adapter_summary(model_shapes)),
        "subclasses": _subclasses(ckpt, keep),
        "tensors": Streamed(sum(1 for r in reports if keep(r.fqn)),
                            lambda: ((r.fqn, _tensor_doc(ckpt, r)) for r in reports if keep(r.fqn))),
        "bytes_entries": {fqn: {"file": b.file, "offset": b.offset, "length": b.length,
                                "transforms": list(b.transforms)}
                          for fqn, b in ckpt.bytes_entries.items() if keep(fqn)},
        "problems": [{"fqn": p.fqn, "kind": p.kind, "message": p.message}
                     for p in analysis.problems if keep(p.fqn)],
    }


def _subclasses(ckpt: Checkpoint, keep: Any) -> dict[str, str]:
    """Tensors whose items hold an FP8 training subclass (torchao's wrapper, TE's Float8Tensor),
    by their first item (`ItemReader.peek_kind`); an item that says so but does not decode is
    shown with the reason."""
    from ckptctl.formats.dcp.items import ItemReader

    found: dict[str, str] = {}
    with ItemReader(ckpt) as reader:
        for fqn, entry in ckpt.tensors.items():
            if not entry.chunks or not keep(fqn):
                continue
            try:
                kind = reader.peek_kind(entry, entry.chunks[0])
            except CheckpointError as exc:
                kind = f"undecodable: {exc}"
            if kind is not None:
                found[fqn] = kind
    return found


def _megatron_core_doc(ckpt: Checkpoint) -> dict[str, str] | None:
    from ckptctl.formats.megatron_args import megatron_core_versions

    found = megatron_core_versions(ckpt)
    return None if found is None else {"versions": found.versions, "evidence": found.evidence}


TRAINING_FIELDS = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
                   "vpp": "virtual_pipeline_model_parallel_size",
                   "dp": "data_parallel_size", "ep": "expert_model_parallel_size",
                   "etp": "expert_tensor_parallel_size", "cp": "context_parallel_size", "iteration": "iteration",
                   "first_stage_layers": "decoder_first_pipeline_num_layers",
                   "last_stage_layers": "decoder_last_pipeline_num_layers",
                   "optimizer_instances": "num_distributed_optimizer_instances"}
"""`training` in the JSON document: Megatron's args by the names Megatron gives them (and
`pipeline_layout`, its `pipeline_model_parallel_layout` string). With several distributed
optimizer instances each shards its state over DP / instances ranks, and one instance saves it."""


def _format(ckpt: Checkpoint, training: "TrainingArgs | None") -> str:
    """`format` in the JSON document: a torch_dist checkpoint by its `metadata.json`, Megatron-FSDP's
    by the `ckpt_format` its saved args name; any other DCP checkpoint `dcp`."""
    if ckpt.megatron_backend is not None:
        return FORMATS[ckpt.megatron_backend]
    if training is not None and training.where == "args entry" and training.get("ckpt_format") == FSDP_DTENSOR:
        return FORMATS[FSDP_DTENSOR]
    return "dcp"


def _training_doc(found: "TrainingArgs | None") -> dict[str, Any] | None:
    if found is None:
        return None
    values = {key: found.get(name) for key, name in TRAINING_FIELDS.items()}
    layout = found.get("pipeline_model_parallel_layout")
    return {"from": found.where, **{k: v if isinstance(v, int) and not isinstance(v, bool) else None
                                    for k, v in values.items()},
            "pipeline_layout": layout if isinstance(layout, str) else None, "problem": found.problem}


def _training_line(doc: dict[str, Any]) -> str:
    if doc["problem"]:
        return f"args in {doc['from']} {doc['problem']}"
    sizes = " × ".join(f"{k.upper()} {doc[k]}" for k in ("tp", "pp", "dp") if doc[k] is not None)
    parts = [f"{k.upper()} {doc[k]}" for k in ("vpp", "ep", "etp", "cp")
             if doc[k] is not None and not (k == "etp" and doc[k] == doc["tp"])]  # ETP: the TP by default
    parts += [f"{end} stage {doc[f'{end}_stage_layers']} layers" for end in ("first", "last")
              if doc[f"{end}_stage_layers"] is not None]
    parts += [f"layout {doc['pipeline_layout']}"] if doc["pipeline_layout"] else []
    instances = doc["optimizer_instances"]
    parts += [f"{instances} distributed optimizer instances"] if instances is not None and instances > 1 else []
    more = ", ".join(parts)
    step = f", iteration {doc['iteration']}" if doc["iteration"] is not None else ""
    return f"{sizes or 'sizes not saved'}{f' ({more})' if more else ''}{step} (args in {doc['from']})"


FSDP_DTENSOR = "fsdp_dtensor"
FORMATS = {"torch_dist": "megatron-core torch_dist", FSDP_DTENSOR: "megatron-fsdp fsdp_dtensor"}
"""`format` in the JSON document: `dcp`, the Megatron-Core dist_checkpointing backend, or Megatron-FSDP's."""
FORMAT_LINES = {"megatron-core torch_dist": "Megatron-Core dist_checkpointing, torch_dist backend (metadata.json): "
                                            "{keys} keys, fc1 as [W_all; V_all] or weight_w/weight_v (TP-invariant)",
                "megatron-fsdp fsdp_dtensor": "Megatron-FSDP fsdp_dtensor (args.ckpt_format): per-layer keys, "
                                              "SwiGLU fc1 as weight_w/weight_v (or fused, TP-blocked)"}

OPTIMIZER_LINES = {
    "fully_reshardable": "DistributedOptimizer, fully_reshardable: states shaped like their params",
    "fully_sharded_model_space": "DistributedOptimizer, fully_sharded_model_space: each param's TP fragments, "
                                 "cut at DP boundaries",
    "dp_reshardable": "DistributedOptimizer, dp_reshardable: DP bucket buffers (a job at another TP or PP cannot load them)",
}


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "-"


def _unreferenced_warning(doc: dict[str, Any]) -> str:
    names = doc["unreferenced_files"]
    shown = ", ".join(names) if len(names) <= FILES_LISTED else f"{names[0]} … {names[-1]}"
    return f"{counted(len(names), 'data file')} that no entry points to ({shown}): left by another save? Loading ignores them"


def _rank_state_line(state: dict[str, Any]) -> str:
    first, last = state["entries"][0], state["entries"][-1]
    shown = first if first == last else f"{first} … {last}"
    if "loader" in state:  # Megatron's RNG state, per (PP, TP) rank
        grid = ", ".join(f"({pp}, {tp})" for pp, tp in state["grid"])
        return f"{shown}: {state['kind']} of (PP, TP) ranks {grid}, {state['loader']}"
    return f"{shown}: {state['kind']} of DP {state['dp']}, kept by a reshard to DP {state['dp']} only"


def _with_run_config(ckpt: Checkpoint, summary: dict[str, Any] | None) -> dict[str, Any] | None:
    """A Megatron-Bridge adapter summary with the run's α from its run_config.yaml, where the
    checkpoint has one (`run_config`: its path; `run_config_problem`: why it could not be read)."""
    from ckptctl.formats.bridge_run_config import read_bridge_peft, run_config_path
    from ckptctl.util.errors import CheckpointError

    path = run_config_path(ckpt.path) if summary is not None else None
    if path is None:
        return summary
    summary["run_config"] = str(path)
    try:
        summary["alpha"] = read_bridge_peft(path).alpha
    except CheckpointError as exc:
        summary["run_config_problem"] = exc.reason
    return summary


def _print_summary(doc: dict[str, Any]) -> None:
    from ckptctl.families.adapters import summary_line
    from ckptctl.families.bridge_adapters import bridge_summary_line

    files = doc["files"]
    rows = [
        ("Checkpoint", doc["path"]),
        *((("Format", FORMAT_LINES[doc["format"]].format(
            keys="layer-stacked" if doc["layouts"].get("layer-stacked") else "per-layer")),)
          if doc["format"] in FORMAT_LINES else ()),
        *((("Saved by", f"megatron-core {doc['megatron_core']['versions']} ({doc['megatron_core']['evidence']})"),)
          if doc["megatron_core"] else ()),
        *((("Optimizer", OPTIMIZER_LINES[doc["optimizer_format"]]),) if doc["optimizer_format"] else ()),
        *((("Training", _training_line(doc["training"])),) if doc["training"] else ()),
        ("DCP version", f"{doc['version'] or 'unknown'} ({', '.join(doc['metadata_files'])})"),
        ("Saved world size", str(doc["world_size"])),
        ("Files", f"{counted(len(files), 'data file')}, {human_bytes(doc['total_bytes'])}"),
        *(("", line) for line in file_lines(files)),
        *((("Unreferenced", _unreferenced_warning(doc)),) if doc["unreferenced_files"] else ()),
        *(("Per-rank state", _rank_state_line(r)) for r in doc["rank_state"]),
        ("Entries", _counts(doc["groups"])),
        ("Dtypes", _counts(doc["dtypes"])),
        ("Layouts", _counts(doc["layouts"])),
        ("Prefixes", "model " + (", ".join(repr(p) for p in doc["prefixes"]["model"]) or "-")
         + "; optimizer " + (", ".join(repr(p) for p in doc["prefixes"]["optimizer"]) or "-")),
        *(("Subclasses" if i == 0 else "", f"{counted(n, 'tensor')}: {kind}")
          for i, (kind, n) in enumerate(sorted(Counter(doc["subclasses"].values()).items()))),
        *((("Adapters", (bridge_summary_line if doc["adapters"]["kind"].startswith("megatron-bridge")
                          else summary_line)(doc["adapters"])),) if doc["adapters"] else ()),
    ]
    show_rows(rows)


COLUMNS = ("fqn", "shape", "dtype", "size", "layout", "coverage")


def _status(fqn: str, t: dict[str, Any], problems: dict[str, str]) -> str:
    """The coverage column: `complete`, the gaps and overlaps, or the problem a whole tensor has
    (`data-loss`, `shape-mismatch`): never `complete` for a tensor `--check` fails on."""
    cov = t["coverage"]
    if cov["status"] != "complete":
        return ", ".join(f"{k} {cov[k]}" for k in ("gaps", "overlaps") if cov[k])
    return problems.get(fqn, "complete")


def _cells(fqn: str, t: dict[str, Any], problems: dict[str, str]) -> tuple[str, ...]:
    layout = t["layout"] + (f" (tp {t['tp_degree']})" if t["tp_degree"] else
                            f" (dim 1 in {t['dim1_parts']})" if t["dim1_parts"] else "")
    return (fqn, str(t["shape"]), t["dtype"], human_bytes(t["nbytes"]), layout, _status(fqn, t, problems))


_GAP = 3
"""Columns between two cells of the tensor table: a padding space, the divider, a padding space."""


def _print_tensors(tensors: dict[str, Any], problems: dict[str, str]) -> None:
    rows = [_cells(fqn, t, problems) for fqn, t in tensors.items()]
    title = counted(len(rows), "tensor")
    widths = [max(len(row[i]) for row in (COLUMNS, *rows)) for i in range(len(COLUMNS))]
    if not stdout().is_terminal:  # a pipe: aligned columns, no box, nothing trailing
        text = "".join("  ".join(cell.rjust(w) if i == 3 else cell.ljust(w)
                                 for i, (cell, w) in enumerate(zip(row, widths))).rstrip() + "\n"
                       for row in (COLUMNS, *rows))
        write_out(f"{title}\n{text}")
        return
    from rich import box
    from rich.table import Table
    from rich.text import Text

    console = stdout()
    room = max(console.width - sum(widths[1:]) - _GAP * (len(COLUMNS) - 1), 12)
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("fqn", overflow="fold", min_width=min(room, widths[0]))
    for name in COLUMNS[1:]:
        table.add_column(name, no_wrap=True, justify="right" if name == "size" else "left")
    for row in rows:
        bad = row[5] != "complete"
        table.add_row(Text("\n".join(fold_name(row[0], room)), style="red" if bad else ""), *row[1:5],
                      Text(row[5], style="bold red" if bad else "green"))
    console.print(table)


def _print_chunks(tensors: dict[str, Any]) -> None:
    for fqn, t in tensors.items():
        stdout().print(fqn, markup=False, highlight=False)
        for c in t["chunks"]:
            extra = f"  transforms {','.join(c['transforms'])}" if c["transforms"] else ""
            stdout().print(f"  {c['file']}  bytes {c['offset']}+{c['length']}  offsets {c['offsets']}  "
                           f"sizes {c['sizes']}{extra}", markup=False, highlight=False)


def _print_problems(problems: list[dict[str, Any]]) -> None:
    if not stdout().is_terminal:
        heading = f"{counted(len(problems), 'problem')}:" if problems else "No coverage or consistency problems."
        write_out("".join(f"{line}\n" for line in (heading, *("  " + p["message"] for p in problems))))
        return
    if not problems:
        stdout().print("[green]No coverage or consistency problems.[/green]")
        return
    from rich.text import Text

    stdout().print(Text(f"{counted(len(problems), 'problem')}:", style="bold red"))
    for p in problems:
        stdout().print(Text("  " + p["message"], style="red"), soft_wrap=False)  # wrapped at words


@app.command("inspect")
def inspect_command(
    ckpt: Path = typer.Argument(..., help="DCP checkpoint directory, or a Trainer checkpoint-N folder."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
    pattern: Optional[str] = typer.Option(None, "--filter", help="Only FQNs matching this glob (fnmatch)."),
    chunks: bool = typer.Option(False, "--chunks", help="List every chunk: file, byte range, offsets, sizes."),
    check: bool = typer.Option(False, "--check", help="Print only the problems, one per line; exit 1 if any."),
) -> None:
    """Summarise a checkpoint: files, entries, dtypes, layouts, coverage; --check fails on problems.

    Examples:
      ckptctl inspect demo/ckpt
      ckptctl inspect demo/ckpt --check
      ckptctl inspect demo/ckpt --json --filter 'model.*'
    """

    def body() -> dict[str, Any]:
        from ckptctl.formats.dcp.metadata import open_checkpoint
        from ckptctl.core.analysis import analysis

        opened = open_checkpoint(ckpt)
        doc = inspect_document(opened, analysis(opened), pattern)
        if pattern is not None and not doc["tensors"] and not doc["bytes_entries"]:
            total = len(opened.tensors) + len(opened.bytes_entries)
            raise UsageError(f"--filter {pattern!r} matches none of the {total} entries")
        return doc

    from ckptctl.formats.automodel_peft import automodel_peft
    from ckptctl.storage.trainer_folder import trainer_folder

    if (automodel := run_guarded(lambda: automodel_peft(ckpt))) is not None:  # a NeMo Automodel PEFT folder
        from ckptctl.commands.automodel_peft import describe, summary_lines

        found = run_guarded(lambda: describe(automodel))
        if json_out:
            emit_json(found)
        else:
            for line in summary_lines(found):
                write_line(line)
        return
    if (folder := run_guarded(lambda: trainer_folder(ckpt))) is not None:  # an HF Trainer / accelerate checkpoint-N/
        from ckptctl.cli.inspect_folder import show_folder

        if run_guarded(lambda: show_folder(folder, pattern, json_out, chunks, check)) and check:
            raise typer.Exit(EXIT_PROBLEMS)
        return
    doc = run_guarded(body)
    if json_out:
        emit_json(doc)
    elif check:
        for p in doc["problems"]:
            write_line(p["message"])
        if not doc["problems"]:
            write_line(f"ok: {counted(len(doc['tensors']), 'tensor')} complete and consistent")
        if doc["unreferenced_files"]:
            write_line(f"warning: {_unreferenced_warning(doc)}")
    else:
        _print_summary(doc)
        _print_tensors(doc["tensors"], {p["fqn"]: p["kind"] for p in doc["problems"]})
        if chunks:
            _print_chunks(doc["tensors"])
        _print_problems(doc["problems"])
    if check and doc["problems"]:
        raise typer.Exit(EXIT_PROBLEMS)
