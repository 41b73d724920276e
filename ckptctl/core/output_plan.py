"""The one kind of plan every writing command hands the engine.

reshard and import-hf (a DCP directory), export-hf (safetensors files and their index) and
export-torch (one torch.save archive) differ in what they lay out, not in how it is written:
an output is files of sizes known before any byte moves, bytes known up front (headers, bytes
entries), records assembled from source chunks, and what must come last (`.metadata`,
`index.json`, an archive's central directory). A format describes its records and builds an
`OutputPlan`; `engine.output` writes any of them, a torchrun worker or the helper process only
its own files' records, made when read and their copy runs planned a batch at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Container, Iterable, Mapping, Sequence

from ckptctl.core.plan import CopyItem, SourceTensor, StreamItem


@dataclass(frozen=True)
class OutputPlan:
    """An output decided before any byte moves; `engine.output.write_output` executes it."""

    files: Mapping[str, int]
    """Every output file's name and size."""
    records: Callable[[Container[str]], Iterable[StreamItem]]
    """The records of the named files, made as they are read, their copy runs not yet planned
    (they are planned from `sources` a batch at a time, just before they are written)."""
    record_count: int
    """How many records `records` makes for all the files (a large count is worth a helper process)."""
    sources: Mapping[str, SourceTensor]
    copies: Sequence[CopyItem] = ()
    """Bytes written verbatim: headers, bytes entries, records kept as they were."""
    finish: Callable[[Path], None] | None = None
    """Writes into the output directory what the records do not hold (`.metadata`, `index.json`,
    side files, an archive's central directory): before the output takes its name, and after the
    records only where it reads them (`finish_reads_records`)."""
    finish_reads_records: bool = False
    """Whether `finish` needs what writing the records computed (a torch.save archive's CRCs).
    If not, a helper process or the first torchrun worker runs it while the records are written."""
    finish_load: int = 0
    """What `finish` costs, in bytes of the files that take as long to write: the process that runs
    it while the others write takes that much less of the files."""
    whole_records: bool = False
    """Whether every record is checked, as its runs are planned, to be covered by them (where no
    analysis of the source's coverage came before, or as a second check of a mapping)."""

    def share_bytes(self, names: Container[str]) -> int:
        """The bytes of the named files."""
        return sum(size for name, size in self.files.items() if name in names)
