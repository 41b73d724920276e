"""The one interface of a model family, so export, import and Megatron reshard call methods
instead of asking which kind of family they hold (Megatron rules, torchtitan's adapter, raw).
"""

from __future__ import annotations

import enum
from typing import Iterable, Mapping, Protocol

from ckptctl.families.base import Exported, ExportContext, HFConfig


class Naming(enum.Enum):
    """The names a family's checkpoints hold their model tensors under: what picks the family for
    a checkpoint, and which checkpoint an import can write with it."""

    MEGATRON = "megatron"
    TORCHTITAN = "torchtitan"
    HF = "hf"  # already Hugging Face's: exported as saved (`--arch raw`, `automodel`)


class ModelFamily(Protocol):
    """A model family as every command sees it."""

    name: str
    """Its `--arch` name."""
    model_types: tuple[str, ...]
    """The HF `model_type`s whose config picks it for a checkpoint of its naming (none: raw)."""

    @property
    def naming(self) -> Naming: ...

    def to_hf(self, ctx: ExportContext) -> Mapping[str, Exported]:
        """Every HF tensor of the checkpoint as rows of its tensors (the export plan)."""
        ...

    def mtp_prefixes(self, cfg: HFConfig) -> tuple[str, ...]:
        """The HF names of its multi-token prediction layers (no transformers class holds them)."""
        ...

    def megatron_tensors(self) -> Iterable[tuple[str, str]]:
        """Every Megatron name pattern it maps (`{L}` layer, `{e}` expert) with its TP kind."""
        ...

    def gated_mlp(self) -> bool | None:
        """Whether Megatron's fc1 of it is gated (`[W; V]` per TP rank); None for a family whose
        checkpoints are not Megatron's."""
        ...


class NotMegatron:
    """The answers of a family whose checkpoints are not Megatron's (torchtitan's, HF-named): no
    multi-token prediction layers, no Megatron tensors, no Megatron fc1."""

    def mtp_prefixes(self, cfg: HFConfig) -> tuple[str, ...]:
        return ()

    def megatron_tensors(self) -> tuple[tuple[str, str], ...]:
        return ()

    def gated_mlp(self) -> None:
        return None
