"""ckptctl: inspect, reshard and export PyTorch Distributed Checkpoints offline.

The library behind the command line, for scripts::

    import ckptctl

    ckpt = ckptctl.open_checkpoint("step-1000")            # metadata only: tensors, chunks, files
    for problem in ckptctl.analysis(ckpt).problems:         # what `ckptctl inspect --check` prints
        print(problem.message)
    report = ckptctl.reshard("step-1000", "step-1000-ws8", ckptctl.ReshardOptions(world_size=8), verify=True)
    ckptctl.export_hf("step-1000", "hf", "hf-config", ckptctl.ExportOptions(dtype=None))
    assert ckptctl.diff("step-1000", "step-1000-ws8").equal

Every function takes paths as `str` or `os.PathLike`, returns a report dataclass, and
raises a `CkptctlError` (the CLI's one-line errors) on bad input. Names are imported on
first use, so `import ckptctl` stays as cheap as the command line's start-up.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # typing is not imported at run time: it is most of this module's import cost
if TYPE_CHECKING:
    from typing import Any

__version__ = "0.1.0"

_API = {
    "open_checkpoint": "ckptctl.formats.dcp.metadata",
    "Checkpoint": "ckptctl.core.checkpoint",
    "analysis": "ckptctl.core.analysis",
    "reshard": "ckptctl.commands.reshard",
    "ReshardOptions": "ckptctl.commands.reshard",
    "ReshardReport": "ckptctl.commands.reshard",
    "export_hf": "ckptctl.commands.export_hf",
    "ExportOptions": "ckptctl.commands.export_hf",
    "ExportReport": "ckptctl.commands.export_hf",
    "preview_export": "ckptctl.commands.export_hf",
    "ExportPreview": "ckptctl.commands.export_hf",
    "import_hf": "ckptctl.commands.import_hf",
    "ImportOptions": "ckptctl.commands.import_hf",
    "ImportReport": "ckptctl.commands.import_hf",
    "export_torch": "ckptctl.commands.export_torch",
    "ExportTorchOptions": "ckptctl.commands.export_torch",
    "ExportTorchReport": "ckptctl.commands.export_torch",
    "diff": "ckptctl.commands.diff",
    "DiffReport": "ckptctl.commands.diff",
    "CkptctlError": "ckptctl.util.errors",
    "CheckpointError": "ckptctl.util.errors",
    "OutputError": "ckptctl.util.errors",
    "UsageError": "ckptctl.util.errors",
    "IncompleteCheckpointError": "ckptctl.util.errors",
}
__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptctl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
