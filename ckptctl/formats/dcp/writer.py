"""Place and describe a DCP checkpoint that torch's own `FileSystemReader` loads.

`place_dcp_records` decides, before any byte moves, which file and byte range every output item
gets (rank r's chunks in `__r_0.distcp`, bytes entries verbatim in rank 0's file), so
workers can write items in any order and in parallel. `DcpOutput.output_plan` hands it to the
engine as an `OutputPlan`: each record is made, and its copy runs planned, only when it is about
to be written, so a torchrun worker makes its own files' records and no process holds every
record's runs. `write_metadata` writes the `.metadata` pickle, naming torch's own metadata
classes (`dcp.classes`), from the plan alone: while the records are written, by the process that
takes fewer of them for it (`metadata_load`).
"""

from __future__ import annotations

import functools
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Container, Iterator, Mapping, Sequence
from zlib import crc32

from ckptctl.formats.dcp import metadata_out
from ckptctl.formats.dcp.metadata_out import StreamedDict, StreamedList
from ckptctl.formats.dcp.classes import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
    size,
)
from ckptctl.core.dtypes import DType
from ckptctl.util.gc_pause import gc_paused
from ckptctl.formats.dcp.te_float8 import float8_of, stored_dtype
from ckptctl.formats.torch_save.zip import TorchSaveRecord, serialization_id
from ckptctl.core.checkpoint import BytesEntry
from ckptctl.core.output_plan import OutputPlan
from ckptctl.families.placement import Placed
from ckptctl.core.plan import CopyItem, SourceTensor, StreamItem, TargetTensor
from ckptctl.storage.store import store_for

DCP_VERSION = "1.0.0"


METADATA_RECORD_SECONDS, RECORD_SECONDS, WRITE_BYTES_PER_SECOND = 8e-6, 40e-6, 1e9
"""What `.metadata` costs a record, what writing a record costs besides its bytes, and the rate of
those bytes, on one core (2,560,000 chunks resharded to 512 ranks: `.metadata` 10.4 s, the 1.28
million records 50.6 s; a 2.2 GB reshard of a few hundred records about 1 GB/s)."""


def metadata_load(records: int, nbytes: int, record_seconds: float = METADATA_RECORD_SECONDS) -> int:
    """The bytes of an output of `records` records and `nbytes` bytes that take as long to write as
    its `.metadata` (or as a task of `record_seconds` a record takes): a fifth of a million tiny
    records' bytes, next to nothing of a model's."""
    seconds = records * record_seconds
    writing = records * RECORD_SECONDS + nbytes / WRITE_BYTES_PER_SECOND
    return int(nbytes * seconds / writing) if writing else 0


def rank_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


@dataclass
class DcpOutput:
    """Everything needed to write a DCP checkpoint: items with their places, and its metadata."""

    files: dict[str, int]
    records: DcpRecords
    """The target chunks' records, each made when written (`DcpRecords.in_files`)."""
    copy_items: list[CopyItem]
    targets: dict[str, TargetTensor]
    bytes_entries: dict[str, CopyItem]
    bytes_transforms: dict[str, tuple[str, ...]]
    planner_data: dict[str, Any] | None
    sources: Mapping[str, SourceTensor] = field(default_factory=dict, repr=False)
    """The source views the records' pieces read: their copy runs are planned from them as
    they are written (`plan.planned_batches`)."""
    extra_files: dict[str, bytes] = field(default_factory=dict)
    """Files beside the DCP ones, written with `.metadata` (a torch_dist checkpoint's
    `metadata.json` and `common.pt`)."""
    literal_tensors: dict[str, tuple[DType, tuple[int, ...], CopyItem]] = field(default_factory=dict)
    """Tensors no source holds (torch Adam's per-param step in a converted checkpoint), each one
    record built when planned: fqn → dtype, shape and the record, written as a copy item."""
    masters: dict[str, TargetTensor] = field(default_factory=dict)
    """Master copies laid out from a map the source does not record (a DistributedOptimizer's
    fp32 params out of its buckets or fragments) → the weight each must equal once cast to the
    weight's dtype, read from the source views: `--verify` checks them, proving that map by the
    checkpoint's own values."""

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())

    def output_plan(self) -> OutputPlan:
        """This output as the engine writes it: the copies and records, then `.metadata` and the
        extra files, which need the plan alone (a helper process may write them meanwhile)."""
        return OutputPlan(self.files, self.records.in_files, len(self.records), self.sources, self.copy_items,
                          finish=functools.partial(write_metadata, self),
                          finish_load=metadata_load(len(self.records), self.total_bytes))

    def append_literal(self, fqn: str, data: bytes) -> None:
        """Write `data` as bytes entry `fqn` at the end of rank 0's file (a rewritten entry)."""
        self.bytes_entries[fqn] = self._appended(data)
        self.bytes_transforms[fqn] = ()

    def append_literal_tensor(self, fqn: str, dtype: DType, shape: tuple[int, ...], raw: bytes) -> None:
        """Write tensor `fqn` of `raw` data (its elements, little-endian) whole, as one record at the
        end of rank 0's file."""
        record = TorchSaveRecord(dtype, shape, serialization_id(f"{fqn}@{[0] * len(shape)}"))
        if len(raw) != record.nbytes:
            raise ValueError(f"{fqn}: {len(raw)} bytes for {record.nbytes}")
        self.literal_tensors[fqn] = (dtype, tuple(shape), self._appended(record.head + raw + record.tail(crc32(raw))))

    def _appended(self, data: bytes) -> CopyItem:
        file = rank_file(0)
        at = self.files.get(file, 0)
        item = CopyItem("", 0, len(data), file, at, data)
        self.files[file] = at + len(data)
        self.files = dict(sorted(self.files.items()))
        self.copy_items.append(item)
        return item


class DcpRecords:
    """Every target chunk's record in planning order (target by target, the order of `.metadata`),
    held as its place in its rank file only: one integer a record, not a `StreamItem`, its `TorchSaveRecord`
    and its file name (about 0.5 KB each, a gigabyte at a million records). Records are made when
    read (`in_files`: a torchrun worker or a helper makes only its own files')."""

    def __init__(self, targets: Sequence[TargetTensor], placements: Mapping[str, Sequence[Placed]],
                 offsets: array, files: Mapping[int, str]) -> None:
        self._targets = list(targets)
        self._placed = [placements[t.fqn] for t in self._targets]
        self._offsets = offsets
        self._files = files  # rank → its file's name, one string for all its records

    def __len__(self) -> int:
        return len(self._offsets)

    def in_files(self, names: Container[str]) -> Iterator[StreamItem]:
        """The records of files `names`, made as they are read."""
        for target, _, placed, file, offset in self.placed_records():
            if file in names:
                key = f"{target.fqn}@{list(placed.box.offsets)}"  # the item's serialization id: equal runs, equal bytes
                float8 = float8_of(target)
                record = TorchSaveRecord(target.dtype, placed.box.sizes, serialization_id(key)) if float8 is None \
                    else float8.record(placed.box, serialization_id(key))
                yield StreamItem(file, offset, record.head, target, placed.box, (), record, record.tail_len)

    def placements(self) -> dict[str, Sequence[Placed]]:
        """Each target's chunks as placed, by name."""
        return dict(zip((t.fqn for t in self._targets), self._placed))

    def target_elements(self) -> Iterator[tuple[TargetTensor, int]]:
        """Each target with the elements its records hold (all of it, unless placed in part)."""
        for target, placed in zip(self._targets, self._placed):
            yield target, sum(p.box.numel for p in placed)

    def placed_records(self) -> Iterator[tuple[TargetTensor, int, Placed, str, int]]:
        """(target, index of the chunk in its target, the chunk, its rank's file, offset in that
        file) of every record, none made. A rank's file name is one string for all its records."""
        offsets, files = iter(self._offsets), self._files
        for target, placed in zip(self._targets, self._placed):
            for j, p in enumerate(placed):
                yield target, j, p, files[p.rank], next(offsets)


@functools.lru_cache(maxsize=4096)
def _record_length(dtype: DType, sizes: tuple[int, ...]) -> int:
    """A chunk's record length: every serialization id has the same length, so shape and dtype fix it."""
    return TorchSaveRecord(dtype, sizes, serialization_id("")).length


def record_length(target: TargetTensor, sizes: tuple[int, ...]) -> int:
    """The length of `target`'s record of a chunk of `sizes` (a TE Float8Tensor item's, for its targets)."""
    float8 = float8_of(target)
    return _record_length(target.dtype, sizes) if float8 is None else float8.record_length(sizes)


def place_dcp_records(
    targets: Sequence[TargetTensor],
    placements: Mapping[str, Sequence[Placed]],
    sources: Mapping[str, SourceTensor],
    bytes_entries: Sequence[BytesEntry],
    planner_data: dict[str, Any] | None,
) -> DcpOutput:
    """Place every target chunk and bytes entry in its rank file (its copy runs are planned when
    it is written, from `sources`)."""
    sizes: dict[str, int] = {}
    copies: dict[str, CopyItem] = {}
    transforms: dict[str, tuple[str, ...]] = {}
    for entry in bytes_entries:
        file = rank_file(0)
        at = sizes.get(file, 0)
        copies[entry.fqn] = CopyItem(entry.file, entry.offset, entry.length, file, at)
        transforms[entry.fqn] = entry.transforms
        sizes[file] = at + entry.length
    offsets = array("q")
    files: dict[int, str] = {}
    for target in targets:
        for placed in placements[target.fqn]:
            file = files.get(placed.rank)
            if file is None:
                file = files[placed.rank] = rank_file(placed.rank)
            at = sizes.get(file, 0)
            offsets.append(at)
            sizes[file] = at + record_length(target, placed.box.sizes)
    return DcpOutput(
        files=dict(sorted(sizes.items())),
        records=DcpRecords(targets, placements, offsets, files),
        copy_items=list(copies.values()),
        targets={t.fqn: t for t in targets},
        bytes_entries=copies,
        bytes_transforms=transforms,
        planner_data=planner_data,
        sources=sources,
    )


def _properties(target: TargetTensor) -> TensorProperties:
    src = target.properties
    return TensorProperties(
        dtype=stored_dtype(target),
        requires_grad=bool(getattr(src, "requires_grad", False)),
    )


def build_metadata(out: DcpOutput) -> Metadata:
    """The `.metadata` object describing `out` (stand-ins that pickle as torch's own classes).

    Its chunk lists and storage dict are streamed (`metadata_out.StreamedList`/`StreamedDict`):
    their records are made as the pickle is written, a batch at a time, from the placements, so
    no record per output chunk is ever held. The bytes are those of the same records held.
    """
    records = out.records
    placed = records.placements()
    transforms = {fqn: list(out.bytes_transforms[fqn]) or None for fqn in out.bytes_entries}
    """Held for the whole dump: the pickler memoizes a list by identity, so none may be freed and its id reused."""

    def chunks(fqn: str) -> Iterator[ChunkStorageMetadata]:
        for p in placed[fqn]:
            yield ChunkStorageMetadata(size(p.box.offsets), size(p.box.sizes))

    def storage() -> Iterator[tuple[MetadataIndex, StorageInfo]]:
        for fqn, copy in out.bytes_entries.items():
            yield MetadataIndex(fqn), StorageInfo(copy.file, copy.offset, copy.length, transforms[fqn])
        for target, index, p, file, offset in records.placed_records():
            # one name a file, as torch's writer shares it: pickled once, then fetched from the memo
            yield (MetadataIndex(target.fqn, size(p.box.offsets), index),
                   StorageInfo(file, offset, record_length(target, p.box.sizes)))
        for fqn, (_, shape, copy) in out.literal_tensors.items():
            yield MetadataIndex(fqn, size((0,) * len(shape)), 0), StorageInfo(copy.file, copy.offset, copy.length)

    sd_md: dict[str, Any] = {fqn: BytesStorageMetadata() for fqn in out.bytes_entries}
    for fqn, (dtype, shape, copy) in out.literal_tensors.items():
        sd_md[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype, requires_grad=False), size(shape),
                                           [ChunkStorageMetadata(size((0,) * len(shape)), size(shape))])
    for fqn, target in out.targets.items():
        sd_md[fqn] = TensorStorageMetadata(_properties(target), size(target.shape),
                                           StreamedList(functools.partial(chunks, fqn), len(placed[fqn])))
    return Metadata(
        state_dict_metadata=sd_md,
        planner_data=out.planner_data,
        storage_data=StreamedDict(storage, len(out.bytes_entries) + len(records) + len(out.literal_tensors)),
        storage_meta=StorageMeta(checkpoint_id=None, save_id=None, modules=[]),
        version=DCP_VERSION,
    )


def metadata_pickle(md: Metadata) -> bytes:
    """The `.metadata` bytes, those `torch_pickle.dumps(md)` writes, a few µs per chunk, without torch."""
    with gc_paused():
        return metadata_out.dumps(md)


def write_metadata(out: DcpOutput, directory: Path) -> None:
    """Write `.metadata` and the extra files into `directory` (the atomic directory fsyncs them
    before the rename)."""
    md = build_metadata(out)
    store = store_for(directory)
    with store.write_stream(directory / ".metadata") as file, gc_paused():
        metadata_out.dump(md, file)
    for name, data in out.extra_files.items():
        store.write_whole(directory / name, data)
