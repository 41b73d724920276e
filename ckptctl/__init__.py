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
import sys
import types

TYPE_CHECKING = False  # typing is not imported at run time: it is most of this module's import cost
if TYPE_CHECKING:
    from typing import Any

__version__ = "0.1.0"

_API = {
    "open_checkpoint": "ckptctl.formats.dcp_metadata",
    "Checkpoint": "ckptctl.model",
    "analysis": "ckptctl.layout",
    "reshard": "ckptctl.reshard",
    "ReshardOptions": "ckptctl.reshard",
    "ReshardReport": "ckptctl.reshard",
    "export_hf": "ckptctl.export_hf",
    "ExportOptions": "ckptctl.export_hf",
    "ExportReport": "ckptctl.export_hf",
    "preview_export": "ckptctl.export_hf",
    "ExportPreview": "ckptctl.export_hf",
    "import_hf": "ckptctl.import_hf",
    "ImportOptions": "ckptctl.import_hf",
    "ImportReport": "ckptctl.import_hf",
    "export_torch": "ckptctl.export_torch",
    "ExportTorchOptions": "ckptctl.export_torch",
    "ExportTorchReport": "ckptctl.export_torch",
    "diff": "ckptctl.diff",
    "DiffReport": "ckptctl.diff",
    "CkptctlError": "ckptctl.errors",
    "CheckpointError": "ckptctl.errors",
    "OutputError": "ckptctl.errors",
    "UsageError": "ckptctl.errors",
    "IncompleteCheckpointError": "ckptctl.errors",
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


class _Api(types.ModuleType):
    """The package as a module whose API functions keep their names: importing submodule
    `ckptctl.reshard` (by `ckptctl.ReshardOptions`, or by another module) would otherwise set the
    package's `reshard` to that module, and `ckptctl.reshard(...)` after it would call a module."""

    def __setattr__(self, name: str, value: Any) -> None:
        if not (isinstance(value, types.ModuleType) and _API.get(name) == value.__name__):
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Api
