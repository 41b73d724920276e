"""Stand-ins for DCP's `.metadata` classes: the same fields, unpickled from and pickled as torch's.

Importing `torch.distributed.checkpoint` costs more than half a second (it pulls in
DTensor), so `.metadata` is read into these plain classes (the restricted unpickler maps
DCP's class names to them) and written from them (`torch_pickle` names DCP's classes), and
torch's own `dcp.load` reads the result as if DCP had written it. Fields and pickled state
follow torch's classes in `torch.distributed.checkpoint.metadata` and `.filesystem`.
"""

from __future__ import annotations

from array import array
from typing import Any, ClassVar, Iterator

from ckptctl.formats.pickle.torch_pickle import Call, Instance, Size, ref

DCP_METADATA = "torch.distributed.checkpoint.metadata"
DCP_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
DCP_PLANNER = "torch.distributed.checkpoint.planner"
MCORE_TORCH = "megatron.core.dist_checkpointing.strategies.torch"


class _DcpRecord:
    """Fields in `__dict__`, pickled as DCP pickles its dataclasses: NEWOBJ, then the field dict."""

    MODULE: ClassVar[str] = DCP_METADATA
    TORCH_NAME: ClassVar[str | None] = None  # the class's name in torch, when it differs from ours
    FIELDS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def torch_global(cls) -> tuple[str, str]:
        return cls.MODULE, cls.TORCH_NAME or cls.__name__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        values = dict(zip(self.FIELDS, args))
        values.update(kwargs)
        for name in self.FIELDS:
            setattr(self, name, values.get(name))

    def __init_subclass__(cls) -> None:
        # A field an older torch did not pickle reads as None. Class attributes do that without a
        # __getattr__ or __setstate__, so unpickling stays C's plain __dict__ update (3x faster).
        for name in cls.FIELDS:
            if name not in cls.__dict__:
                setattr(cls, name, None)

    def __eq__(self, other: object) -> bool:
        """Equal fields, a field left out (read as None) equal to one set to None: torch leaves out
        a bytes entry's key offset and a storage entry's absent transforms, older torch others."""
        return type(other) is type(self) and _set_fields(other) == _set_fields(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"

    def pickled_state(self) -> dict[str, Any]:
        """The state torch pickles for the record: its fields as set, in order."""
        return dict(vars(self))

    def __torch_pickle__(self) -> Instance:
        return Instance(ref(*self.torch_global()), self.pickled_state())


def _set_fields(record: _DcpRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if v is not None}


class Metadata(_DcpRecord):
    FIELDS = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")


class MCoreMetadata(Metadata):
    """megatron-core ≤ 0.15's Metadata subclass, read as DCP's own (its `mcore_data` dropped): only
    those versions save it (later ones keep the name to load old checkpoints)."""

    MODULE = MCORE_TORCH


class StorageMeta(_DcpRecord):
    FIELDS = ("checkpoint_id", "save_id", "load_id", "modules")


class ChunkStorageMetadata(_DcpRecord):
    FIELDS = ("offsets", "sizes")

    def __init__(self, offsets: Size | None = None, sizes: Size | None = None) -> None:
        """Spelled out, like MetadataIndex's and StorageInfo's: one of each per chunk, 5x faster than generic."""
        self.offsets = offsets
        self.sizes = sizes


class TensorStorageMetadata(_DcpRecord):
    FIELDS = ("properties", "size", "chunks")


class BytesStorageMetadata(_DcpRecord):
    FIELDS = ()


class MetadataIndex(_DcpRecord):
    """Keys `storage_data`; hashable, like DCP's frozen dataclass."""

    FIELDS = ("fqn", "index", "offset")

    def __init__(self, fqn: str | None = None, offset: Size | None = None, index: int | None = None) -> None:
        """Set as torch's `__init__` sets them: `index`, then `offset` only when there is one (a
        bytes entry's key has none), so the state pickles in torch's order with torch's fields."""
        self.fqn = fqn
        self.index = index
        if offset is not None:
            self.offset = offset

    def __hash__(self) -> int:
        return hash((self.fqn, self.offset))


class StorageInfo(_DcpRecord):
    """DCP's `filesystem._StorageInfo`: where an item's bytes are."""

    MODULE = DCP_FILESYSTEM
    TORCH_NAME = "_StorageInfo"
    FIELDS = ("relative_path", "offset", "length", "transform_descriptors")

    def __init__(self, relative_path: str | None = None, offset: int | None = None, length: int | None = None,
                 transform_descriptors: list[str] | None = None) -> None:
        self.relative_path = relative_path
        self.offset = offset
        self.length = length
        self.transform_descriptors = transform_descriptors

    def pickled_state(self) -> dict[str, Any]:
        """As torch's `_StorageInfo.__getstate__`: the fields that are not None."""
        return {k: v for k, v in vars(self).items() if v is not None}


class SavePlan(_DcpRecord):
    """Megatron-Core's torch_dist pickles every rank's save plan beside the metadata
    (`all_local_plans`): read as inert records, never used (the metadata says it all)."""

    MODULE = DCP_PLANNER


class WriteItem(_DcpRecord):
    MODULE = DCP_PLANNER


class TensorWriteData(_DcpRecord):
    MODULE = DCP_PLANNER


class Layout(str):
    """`torch.strided` and friends: DCP pickles a layout as `torch.serialization._get_layout(name)`.

    Named after torch's own `torch.layout`, the class it stands for in pickles (a tensor's memory
    format), not ckptctl's "layout" of a checkpoint across ranks and files."""

    __slots__ = ()

    def __torch_pickle__(self) -> Call:
        return Call(ref("torch.serialization", "_get_layout"), (str(self),))


class MemoryFormat(int):
    """DCP's `_MEM_FORMAT_ENCODING` enum value (0 is torch.contiguous_format)."""

    __slots__ = ()

    def __torch_pickle__(self) -> Call:
        return Call(ref(DCP_METADATA, "_MEM_FORMAT_ENCODING"), (int(self),))


STRIDED = Layout("torch.strided")
CONTIGUOUS = MemoryFormat(0)


class TensorProperties(_DcpRecord):
    """Pickled, like DCP's, with a tuple state (dtype, layout, requires_grad, memory format, pin_memory)."""

    FIELDS = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")

    def __init__(self, dtype: Any = None, layout: Layout = STRIDED, requires_grad: bool = False,
                 memory_format: MemoryFormat = CONTIGUOUS, pin_memory: bool = False) -> None:
        super().__init__(dtype, layout, requires_grad, memory_format, pin_memory)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple):
            state = dict(zip(self.FIELDS, state))
        for name in self.FIELDS:
            setattr(self, name, state.get(name))

    def __torch_pickle__(self) -> Instance:
        return Instance(ref(*self.torch_global()), tuple(getattr(self, f) for f in self.FIELDS))


def size(values: Any) -> Size:
    """A shape or offset as DCP stores it (torch.Size)."""
    return Size(map(int, values))


METADATA_CLASSES: dict[tuple[str, str], Any] = {
    **{c.torch_global(): c for c in (
        Metadata, StorageMeta, ChunkStorageMetadata, TensorStorageMetadata, BytesStorageMetadata,
        MetadataIndex, TensorProperties, StorageInfo)},
    (DCP_METADATA, "_MEM_FORMAT_ENCODING"): MemoryFormat,
    ("torch", "Size"): Size,
}
"""DCP's global names in `.metadata` → the stand-ins the restricted unpickler builds."""


class ChunkColumns:
    """A tensor's `chunks` as two parallel lists (offsets, sizes) of plain int tuples, in order.

    What `dcp.templates` builds in place of a list of ChunkStorageMetadata records: two
    list slots a chunk instead of a record, two Sizes and their state, and equal tuples shared."""

    __slots__ = ("offsets", "sizes")

    def __init__(self) -> None:
        self.offsets: list[tuple[int, ...]] = []
        self.sizes: list[tuple[int, ...]] = []

    def __len__(self) -> int:
        return len(self.offsets)

    def pairs(self) -> Any:
        return zip(self.offsets, self.sizes)


class StorageColumns:
    """`storage_data` as a table: per FQN, each entry's chunk offsets (None for a bytes entry) and
    its (file, byte offset, length) as three integers of one array, files by number.

    Lookups go per tensor (`entries`), so no dict of every (FQN, offsets) key is ever held, and
    the first entry of a key wins, as in a dict filled by `setdefault`."""

    __slots__ = ("rows", "files", "file_ids", "transforms", "transformed")

    def __init__(self) -> None:
        self.rows: dict[str, tuple[list, Any]] = {}
        self.files: list[str] = []
        self.file_ids: dict[str, int] = {}  # each file's number (`file_id` numbers a new one)
        self.transforms: dict[tuple[str, int], tuple[str, ...]] = {}
        self.transformed: set[str] = set()  # the names with a transformed entry

    def add(self, fqn: str, offsets: tuple[int, ...] | None, file: str, offset: int, length: int,
            transforms: Any = None) -> None:
        keys, places = self.rows_for(fqn)
        if transforms:
            self.transforms[fqn, len(keys)] = tuple(transforms)
            self.transformed.add(fqn)
        keys.append(offsets)
        places.extend((self.file_id(file), offset, length))

    def rows_for(self, fqn: str) -> tuple[list, Any]:
        """FQN's columns to append to: its keys, and its places three integers an entry."""
        found = self.rows.get(fqn)
        if found is None:
            found = self.rows[fqn] = ([], array("q"))
        return found

    def file_id(self, file: str) -> int:
        """The number of data file `file` in this table (numbered as met)."""
        found = self.file_ids.get(file)
        if found is None:
            found = self.file_ids[file] = len(self.files)
            self.files.append(file)
        return found

    def __len__(self) -> int:
        return sum(len(keys) for keys, _ in self.rows.values())

    def rows_of(self, fqn: str) -> Iterator[tuple[tuple[int, ...] | None, tuple[str, int, int, tuple[str, ...]]]]:
        """FQN's entries in order: (offsets, (file, byte offset, length, transforms))."""
        keys, places = self.rows.get(fqn, ((), ()))
        files, transforms = self.files, self.transforms
        for row, key in enumerate(keys):
            at = 3 * row
            yield key, (files[places[at]], places[at + 1], places[at + 2], transforms.get((fqn, row), ()))

    def entries(self, fqn: str) -> dict[tuple[int, ...] | None, tuple[str, int, int, tuple[str, ...]]]:
        """FQN's entries: offsets → (file, byte offset, length, transforms), the first of a key kept."""
        out: dict = {}
        for key, entry in self.rows_of(fqn):
            out.setdefault(key, entry)
        return out
