"""A config's layer and expert counts checked against the weights before a model is built of it.

The names check builds the config's transformers model on the meta device: no weight takes
memory there, whatever the sizes, but every layer (and, in some models, every expert) is
Python modules, so a 700-byte `config.json` claiming 20,000 layers cost gigabytes and
minutes before any shape was compared. A count the weights cannot back (more layers than
any numbered list of modules in the names, or a layer pattern as long) is refused here,
naming the key; the cost of what is built then stays proportional to the input, and the
precise shape check (`ExpectedNames.misshapen`) still judges every size.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from ckptctl.util.errors import CheckpointError
from ckptctl.util.wording import counted

LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
"""Config keys holding the number of decoder layers (GPT-2 and others spell it `n_layer`)."""
LAYER_PATTERNS = ("hybrid_override_pattern", "layer_types", "layers_block_type")
"""Config keys whose length is the number of layers (Nemotron-H's pattern, per-layer kinds)."""
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
SUB_CONFIGS = ("text_config", "decoder", "generator")
"""Where a composite config keeps its text decoder, with counts of its own."""
_NUMBERED = re.compile(r"\.(\d+)(?=\.|$)")
_STACKED = re.compile(r"(?:^|\.)layers\.(?!\d)")
"""torch_dist's layer stacks (`decoder.layers.self_attention…`): dim 0 is the layer."""


def weight_capacity(shapes: Mapping[str, Sequence[int]]) -> tuple[int, int]:
    """(the most layers the weights hold: the longest numbered list of modules in the names, or
    the deepest layer stack; the largest dim of any tensor)."""
    lists: dict[str, set[str]] = {}
    layers = largest = 0
    for name, shape in shapes.items():
        dotted = "." + name
        for m in _NUMBERED.finditer(dotted):
            lists.setdefault(dotted[:m.start()], set()).add(m.group(1))
        if shape:
            largest = max(largest, *shape)
            if _STACKED.search(name):
                layers = max(layers, shape[0])
    return max(layers, max(map(len, lists.values()), default=0)), largest


def _counts(config: Mapping[str, Any]) -> Iterator[tuple[str, int, bool]]:
    """(key as shown, the count it claims, whether it counts layers) of every layer and expert count."""
    scopes = [("", config)] + [(f"{k}.", config[k]) for k in SUB_CONFIGS if isinstance(config.get(k), dict)]
    for where, scope in scopes:
        for key in LAYER_KEYS + EXPERT_KEYS:
            value = scope.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                yield f"{where}{key}={value}", value, key in LAYER_KEYS
        for key in LAYER_PATTERNS:
            value = scope.get(key)
            if isinstance(value, (str, list)):
                yield f"{where}{key} of {len(value)} layers", len(value), True


def refuse_unbacked_counts(config: Mapping[str, Any], config_path: Path, shapes: Mapping[str, Sequence[int]],
                           weights: Path, hint: str) -> None:
    """Refuse a config claiming more layers than the weights hold, or more experts than any list of
    modules or any dim of theirs: CheckpointError naming the key and what the weights hold."""
    layers, largest = weight_capacity(shapes)
    for shown, count, of_layers in _counts(config):
        if of_layers and count > layers:
            raise CheckpointError(config_path, f"{shown}, but the weights in {weights} hold at most "
                                               f"{counted(layers, 'layer')} ({hint})")
        if not of_layers and count > max(layers, largest):
            raise CheckpointError(config_path, f"{shown}, but the weights in {weights} hold at most "
                                               f"{counted(max(layers, largest), 'expert')} ({hint})")
