"""Megatron's `args` entry: the training settings saved beside a Megatron-FSDP checkpoint.

An `argparse.Namespace`, pickled by `torch.save` into a DCP bytes entry; read with torch's
restricted loader allowing that one class (its values are plain data), so the training
TP size and model dims can be taken from it.
"""

from __future__ import annotations

import argparse

from ckptctl.formats.dcp_items import ItemReader
from ckptctl.model import Checkpoint


def checkpoint_args(ckpt: Checkpoint) -> argparse.Namespace | None:
    """The `args` entry Megatron saves (an argparse.Namespace), read with a restricted unpickler."""
    entry = ckpt.bytes_entries.get("args")
    if entry is None:
        return None
    with ItemReader(ckpt) as reader:
        value = reader.load_bytes_value(entry, safe_globals=[argparse.Namespace])
    return value if isinstance(value, argparse.Namespace) else None
