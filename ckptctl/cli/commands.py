"""Imports every command module so each registers itself on the typer app."""

from ckptctl.cli import inspect_cmd  # noqa: F401
from ckptctl.cli import reshard_cmd  # noqa: F401
from ckptctl.cli import export_cmd  # noqa: F401
from ckptctl.cli import import_cmd  # noqa: F401
from ckptctl.cli import diff_cmd  # noqa: F401
from ckptctl.cli import export_torch_cmd  # noqa: F401
