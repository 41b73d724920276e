"""`--arch raw`: checkpoints whose model FQNs already are Hugging Face names (FSDP2, torchtitan).

`get_state_dict` puts the model under `model.`; that one prefix is stripped when every
model key has it (and peft's `base_model.model.` after it), and each tensor is exported whole,
unchanged. Optimizer state and other non-model entries are left out; with tied embeddings
`lm_head.weight` is not written (export-hf first proves it equal to the embeddings, `base.TiedHead`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ckptctl.core.dtypes import DType
from ckptctl.families.adapters import peft_prefix
from ckptctl.families.base import ExportContext, TiedHead, is_model_key
from ckptctl.families.protocol import Naming, NotMegatron
from ckptctl.core.checkpoint import Checkpoint
from ckptctl.core.plan import Piece, TargetTensor

PREFIX = "model."
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
TIE_KEY = "tie_word_embeddings"


def raw_prefix(ckpt: Checkpoint) -> str:
    """`model.` when every model key has it, then peft's `base_model.model.` when every key has
    that too (a `PeftModel`'s state dict: `families.adapters`)."""
    keys = [fqn for fqn in ckpt.tensors if is_model_key(fqn)]
    prefix = PREFIX if keys and all(k.startswith(PREFIX) for k in keys) else ""
    return prefix + peft_prefix([k[len(prefix):] for k in keys])


@dataclass(frozen=True)
class RawTensor:
    """A source tensor exported whole under its own (stripped) name."""

    name: str
    fqn: str
    shape: tuple[int, ...]
    add: float = 0.0

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.fqn,)

    def target(self, dtype: DType) -> TargetTensor:
        zero = tuple(0 for _ in self.shape)
        return TargetTensor(self.name, self.shape, dtype, (Piece(self.fqn, zero, zero, self.shape),))


@dataclass(frozen=True)
class RawFamily(NotMegatron):
    name: str = "raw"
    model_types: tuple[str, ...] = ()
    naming: ClassVar[Naming] = Naming.HF

    def to_hf(self, ctx: ExportContext) -> dict[str, RawTensor]:
        m = ctx.model
        tied = ctx.config.flag(TIE_KEY, False)
        out: dict[str, RawTensor] = {}
        for name, entry in sorted(m.entries.items()):
            m.used.add(name)
            if tied and name == HEAD and EMBED in m.entries:
                ctx.tied_heads.append(TiedHead(RawTensor(name, entry.fqn, entry.shape), EMBED, TIE_KEY))
                continue
            out[name] = RawTensor(name, entry.fqn, entry.shape)
        return out


RAW = RawFamily()
