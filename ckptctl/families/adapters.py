"""HF `peft` LoRA adapters in a checkpoint: their names, how A and B pair with a base weight, their scale.

A peft model's state dict (what FSDP2's `get_model_state_dict` saves) wraps the HF model in
`base_model.model.`; an adapted linear keeps its weight as `<m>.base_layer.weight` and holds
`<m>.lora_A.<adapter>.weight` [r, in] and `<m>.lora_B.<adapter>.weight` [out, r], where
`<adapter>` is the adapter's name (`default`). Merged, the HF weight `<m>.weight` is
W + (B @ A) · s with s = α / r (α / √r with rsLoRA); DoRA adds a magnitude
`<m>.lora_magnitude_vector.<adapter>.weight` [out] that rescales each merged row. An
embedding's adapter is `<m>.lora_embedding_A.<adapter>` [r, vocab] and `…_B.<adapter>`
[dim, r], merged transposed: W + ((B @ A) · s)ᵀ. α is not in the checkpoint: it comes
from the run's `adapter_config.json` or the command line, never from a guess. A PEFT folder
names the same tensors `base_model.model.<m>.lora_A.weight` (no adapter name).

A LoRA on a parameter (peft's `target_parameters`, its `ParamWrapper`: transformers 5's fused MoE
expert stacks, `mlp.experts.gate_up_proj` [E, 2F, H]) replaces the module holding the parameter
with a wrapper whose `base_layer` is that module; a second parameter of the module wraps the
wrapper, so its parameters sit under as many `.base_layer` steps as it has wrappers
(`experts.base_layer.base_layer.gate_up_proj`), the outermost wrapper's LoRA at
`experts.lora_A.<adapter>.weight`, the next one's at `experts.base_layer.lora_A.…` (peft nests
them in the order the module registers its parameters, the first innermost). Which parameter a
wrapper adapts is not in the state dict: its shapes say it, and an adapter they do not tell is
refused. Of a stack [E, d1, d2] held as [E, out, in] (or [E, in, out] where transformers'
experts class is `is_transposed`, gpt-oss), A is [E·r, in] (rows expert by expert) and B
[out, r·E] (columns rank by rank, the experts within); merged, expert e's matrix gains
s · B[:, :, e] @ A[e] (transposed for `is_transposed`), as peft's `einsum` computes it; a 2-D
parameter's LoRA is a linear's. A base holding the experts one by one (an HF folder beside a
NeMo Automodel PEFT save) has no stack under the wrappers: the stacks its per-expert tensors
make (`families.experts.stacked_shapes`) tell the parameter.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from collections import Counter
from typing import Any, Collection, Mapping, Sequence

from ckptctl.families.experts import stacked_shapes
from ckptctl.storage.hf_files import read_json_object
from ckptctl.util.errors import CheckpointError, UsageError
from ckptctl.util.wording import counted

PEFT_PREFIX = "base_model.model."
"""What peft's `PeftModel` puts before every name of the model it wraps."""
BASE_LAYER = ".base_layer."
"""An adapted module's own parameters: `<m>.base_layer.weight` is the HF `<m>.weight`."""
_PART = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_magnitude_vector|lora_embedding_A|lora_embedding_B)"
                   r"\.(?P<adapter>[^.]+)(?:\.(?P<param>weight|bias))?$")
_SAVED = re.compile(r"^(?P<module>.+?)\.modules_to_save\.(?P<adapter>[^.]+)\.(?P<param>.+)$")
"""A module peft trains whole (`modules_to_save`): its trained copy, `<m>.modules_to_save.<adapter>.<param>` …"""
_ORIGINAL = re.compile(r"^(?P<module>.+?)\.original_module\.(?P<param>.+)$")
"""… beside the untouched original, `<m>.original_module.<param>`."""
_TOKENS = re.compile(r"(?:^|\.)trainable_tokens_delta\.")
"""peft's trainable tokens (`trainable_token_indices`): `<m>.token_adapter.trainable_tokens_delta.<adapter>`."""
PEFT_CONFIG = "adapter_config.json"
_WRAPPERS = re.compile(r"(?:\.base_layer)+(?=\.|$)")
"""The `.base_layer` steps of peft's wrappers in a name (nested ParamWrappers give several)."""


def unwrapped(name: str) -> str:
    """A peft model's name as the HF model names it: without its wrappers' `.base_layer` steps."""
    return _WRAPPERS.sub("", name)


@dataclass(frozen=True)
class Adapter:
    """One LoRA adapter on one linear module, named as the checkpoint names them without prefix."""

    module: str
    """The HF module path (`model.layers.0.self_attn.q_proj`)."""
    a: str
    b: str
    rank: int
    magnitude: str | None = None
    """DoRA's `lora_magnitude_vector` [out]; None for plain LoRA."""
    embedding: bool = False
    """On an embedding: A [r, vocab] and B [dim, r] (`lora_embedding_A`/`_B`), merged as (B @ A)ᵀ."""
    parameter: str | None = None
    """peft's ParamWrapper (`target_parameters`): the parameter of `module` it adapts; None on a linear."""
    experts: int = 0
    """E of an adapted 3-D expert stack (A [E·r, in], B [out, r·E]); 0 for a matrix."""
    transposed: bool | None = False
    """The stack holds each expert as [in, out] (transformers' `is_transposed`); None when its
    square matrices do not tell."""
    depth: int = 0
    """The chosen adapter's ParamWrappers around this one: its `.base_layer` steps in a PEFT folder."""

    @property
    def weight(self) -> str:
        """The HF name of the weight the adapter is merged into."""
        return f"{self.module}.{self.parameter or 'weight'}"

    @property
    def leaf(self) -> str:
        """The module's last name (`q_proj`), with the parameter's for a ParamWrapper (`experts.gate_up_proj`)."""
        leaf = self.module.rsplit(".", 1)[-1]
        return f"{leaf}.{self.parameter}" if self.parameter is not None else leaf

    @property
    def wrapped(self) -> str:
        """The module as peft names the wrapper holding this adapter (its `.base_layer` steps)."""
        return self.module + ".base_layer" * self.depth


@dataclass(frozen=True)
class PeftAdapters:
    """The adapters of a peft model's checkpoint, and the HF name of each wrapped base tensor."""

    adapters: tuple[Adapter, ...]
    adapter_name: str
    renamed: dict[str, str]
    """`<m>.base_layer.<param>` and a trained copy `<m>.modules_to_save.<adapter>.<param>` → `<m>.<param>`."""
    saved: tuple[str, ...] = ()
    """The modules peft trains whole (`modules_to_save`), sorted."""
    originals: tuple[str, ...] = ()
    """The untouched originals of those modules (`<m>.original_module.<param>`): never exported."""
    others: tuple[str, ...] = ()
    """The tensors of the adapters not chosen (`--adapter-name`): never exported."""
    left_out: tuple[str, ...] = ()
    """The names of those adapters, sorted."""

    @property
    def tensors(self) -> set[str]:
        """Names of the adapter tensors themselves."""
        return {n for a in self.adapters for n in (a.a, a.b, a.magnitude) if n is not None}

    @property
    def trained_copies(self) -> dict[str, str]:
        """Each `modules_to_save` tensor's HF name → its trained copy's name."""
        return {new: old for old, new in self.renamed.items() if _SAVED.match(old)}

    @property
    def dora(self) -> bool:
        return any(a.magnitude is not None for a in self.adapters)

    @property
    def ranks(self) -> list[int]:
        return sorted({a.rank for a in self.adapters})

    @property
    def targets(self) -> list[str]:
        """The adapted modules' leaf names, sorted (PEFT's `target_modules`)."""
        return sorted({a.leaf for a in self.adapters if a.parameter is None})

    @property
    def parameters(self) -> list[str]:
        """The adapted parameters as `<module leaf>.<parameter>`, sorted (PEFT's `target_parameters`)."""
        return sorted({a.leaf for a in self.adapters if a.parameter is not None})


def peft_prefix(names: Sequence[str]) -> str:
    """`base_model.model.` when every name has it (a peft model's state dict), else ''."""
    return PEFT_PREFIX if names and all(n.startswith(PEFT_PREFIX) for n in names) else ""


def find_adapters(shapes: Mapping[str, tuple[int, ...]], where: str | Path, prefix: str = "",
                  chosen: str | None = None) -> PeftAdapters | None:
    """The LoRA adapters among a peft model's tensors (names without `prefix`, the checkpoint's
    up to `base_model.model.`, which messages put back), or None when there are none; of a model
    holding several adapters, those named `chosen` (`--adapter-name`), the others' tensors in
    `others`. Refused, by name: LoRA biases, several adapter names and none chosen (or one chosen
    that is not there), an A without its B (or the reverse), DoRA
    magnitudes on some modules only or on an embedding, a `modules_to_save` copy without its original
    (or the reverse), and shapes that do not pair ([r, in] and [out, r] with a base [out, in], a
    magnitude [out])."""
    parts: dict[tuple[str, str], dict[str, str]] = {}
    saved: dict[tuple[str, str], str] = {}
    originals: dict[str, str] = {}
    for name in sorted(shapes):
        if _TOKENS.search(name):
            raise CheckpointError(where, f"{prefix}{name}: peft trainable tokens (trainable_token_indices), which "
                                         "export-hf does not merge or export yet: without them the export would "
                                         "not be the trained model")
        if (match := _SAVED.match(name)) is not None:
            saved[(f"{match['module']}.{match['param']}", match["adapter"])] = name
            continue
        if (match := _ORIGINAL.match(name)) is not None:
            originals[f"{match['module']}.{match['param']}"] = name
            continue
        match = _PART.match(name)
        if match is None:
            continue
        part = match["part"]
        if match["param"] is None and not part.startswith("lora_embedding"):  # `<m>.lora_A.weight`
            raise CheckpointError(where, f"{prefix}{name}: a LoRA tensor without an adapter name, as a PEFT "
                                         "folder or get_peft_model_state_dict names it; export-hf reads a peft "
                                         "model's own state dict (<m>.lora_A.<adapter>.weight beside "
                                         "<m>.base_layer.weight)")
        if part.startswith("lora_embedding") and match["param"] is None:
            part = "lora_" + part[len("lora_embedding_"):] + " embedding"
        elif match["param"] != "weight":
            raise CheckpointError(where, f"{prefix}{name}: a LoRA bias (lora_bias), which export-hf does not "
                                         "merge or export yet")
        parts.setdefault((match["module"], match["adapter"]), {})[part] = name
    if not parts:
        if saved or originals:
            raise CheckpointError(where, f"{prefix}{next(iter([*saved.values(), *originals.values()]))}: a peft "
                                         "modules_to_save module without any LoRA adapter")
        return None
    names = sorted({adapter for _, adapter in parts} | {adapter for _, adapter in saved})
    if chosen is not None and chosen not in names:
        raise CheckpointError(where, f"has no peft adapter {chosen!r} (--adapter-name): its adapters are "
                                     f"{', '.join(map(repr, names))}")
    if chosen is None and len(names) > 1:
        raise CheckpointError(where, f"{len(names)} peft adapters ({', '.join(names)}): pass --adapter-name to "
                                     "export one")
    chosen = chosen or names[0]
    others = sorted([n for (_, adapter), found in parts.items() if adapter != chosen for n in found.values()]
                    + [n for (_, adapter), n in saved.items() if adapter != chosen])
    every_adapter = parts
    parts = {key: found for key, found in parts.items() if key[1] == chosen}
    saved = {name: copy for (name, adapter), copy in saved.items() if adapter == chosen}
    if not parts:
        raise CheckpointError(where, f"peft adapter {chosen!r} has no LoRA tensor, only modules_to_save copies")
    unpaired = sorted(set(saved) ^ set(originals))
    if unpaired:
        one = saved.get(unpaired[0]) or originals[unpaired[0]]
        raise CheckpointError(where, f"{prefix}{one}: a modules_to_save tensor without its "
                                     f"{'original_module' if unpaired[0] in saved else 'trained copy'} beside it")
    misshapen = [n for n in saved if shapes[saved[n]] != shapes[originals[n]]]
    if misshapen:
        raise CheckpointError(where, f"{prefix}{saved[misshapen[0]]} is {list(shapes[saved[misshapen[0]]])}, its "
                                     f"original_module {list(shapes[originals[misshapen[0]]])}")
    chains = _parameter_chains(every_adapter, shapes, where, prefix)
    chosen_levels: dict[str, list[int]] = {}  # the chosen adapter's wrapper levels of each module, outermost first
    for path, _ in sorted(parts, key=lambda key: wrapper_level(key[0])):
        stem, level = wrapper_level(path)
        chosen_levels.setdefault(stem, []).append(level)
    adapters = []
    for (module, _), found in sorted(parts.items()):
        embedding = "lora_A embedding" in found or "lora_B embedding" in found
        pair = ("lora_A embedding", "lora_B embedding") if embedding else ("lora_A", "lora_B")
        missing = set(pair) - set(found)
        if missing:
            raise CheckpointError(where, f"{prefix}{next(iter(found.values()))} has no {missing.pop()} beside it")
        base = f"{module}{BASE_LAYER}weight"
        a, b = found[pair[0]], found[pair[1]]
        stem, level = wrapper_level(module)
        if base not in shapes and stem in chains:  # peft's ParamWrapper: LoRA on a parameter of `stem`
            if "lora_magnitude_vector" in found:
                raise CheckpointError(where, f"{prefix}{found['lora_magnitude_vector']}: DoRA on a parameter, which "
                                             "peft's ParamWrapper (target_parameters) does not have")
            param, experts, transposed = chains[stem][level]
            rank = shapes[a][0] // (experts or 1)
            if rank == 0:
                raise CheckpointError(where, f"{prefix}{a}: rank 0 (lora_A {list(shapes[a])}): s = α / r has no value")
            adapters.append(Adapter(unwrapped(stem), a, b, rank, parameter=param, experts=experts,
                                    transposed=transposed, depth=chosen_levels[stem].index(level)))
            continue
        if base not in shapes:
            raise CheckpointError(where, f"{prefix}{a}: an adapter on {module}, which has no {prefix}{base}")
        w, sa, sb = shapes[base], shapes[a], shapes[b]
        rows, cols = (w[0] if w else None), (w[1] if len(w) == 2 else None)  # of B @ A
        if embedding:  # merged transposed
            rows, cols = cols, rows
        if len(w) != 2 or len(sa) != 2 or len(sb) != 2 or sa[1] != cols or sb[0] != rows or sa[0] != sb[1]:
            raise CheckpointError(where, f"{prefix}{module}: lora_A {list(sa)} and lora_B {list(sb)} do not pair with "
                                         f"its base weight {list(w)} (want [r, {cols or '?'}] and [{rows or '?'}, r])")
        if sa[0] == 0:
            raise CheckpointError(where, f"{prefix}{a}: rank 0 (lora_A {list(sa)}): s = α / r has no value")
        magnitude = found.get("lora_magnitude_vector")
        if magnitude is not None and embedding:
            raise CheckpointError(where, f"{prefix}{magnitude}: DoRA on an embedding, which export-hf does not merge "
                                         "or export yet")
        if magnitude is not None and shapes[magnitude] != (w[0],):
            raise CheckpointError(where, f"{prefix}{magnitude}: DoRA magnitude {list(shapes[magnitude])}, not "
                                         f"[{w[0]}] as its base weight's rows")
        adapters.append(Adapter(unwrapped(module), a, b, sa[0], magnitude, embedding))
    plain = [a for a in adapters if a.magnitude is None]
    if plain and len(plain) < len(adapters):
        raise CheckpointError(where, f"{prefix}{plain[0].a}: a plain LoRA adapter beside DoRA ones (on "
                                     f"{len(adapters) - len(plain)} of {len(adapters)} modules): peft's use_dora "
                                     "is one flag for all")
    renamed = {n: unwrapped(n) for n in shapes if BASE_LAYER in n and not _PART.match(n)}
    renamed.update({copy: name for name, copy in saved.items()})
    modules = sorted({_SAVED.match(copy)["module"] for copy in saved.values()})
    return PeftAdapters(tuple(adapters), chosen, renamed, tuple(modules), tuple(sorted(originals.values())),
                        tuple(others), tuple(n for n in names if n != chosen))


def wrapper_level(path: str) -> tuple[str, int]:
    """(the module a LoRA tensor's module path wraps, how many wrappers are around this one):
    `experts.base_layer` is (`experts`, 1)."""
    level = 0
    while path.endswith(".base_layer"):
        path, level = path[:-len(".base_layer")], level + 1
    return path, level


def parameter_fit(a: tuple[int, ...], b: tuple[int, ...], param: tuple[int, ...]) -> tuple[int, bool | None] | None:
    """(E, transposed) when A and B are shaped as peft shapes a ParamWrapper's on `param` (E 0 for
    a matrix [out, in]; transposed None when a square stack fits both [E, out, in] and
    [E, in, out]), else None."""
    if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
        return None
    if len(param) == 2:
        return (0, False) if (a[1], b[0]) == (param[1], param[0]) else None
    if len(param) != 3 or not param[0] or a[0] % param[0]:
        return None
    fits = [flag for flag, (cols, rows) in ((False, (param[2], param[1])), (True, (param[1], param[2])))
            if (a[1], b[0]) == (cols, rows)]
    if not fits:
        return None
    return param[0], fits[0] if len(fits) == 1 else None


def _parameter_chains(parts: Mapping[tuple[str, str], Mapping[str, str]], shapes: Mapping[str, tuple[int, ...]],
                      where: str | Path, prefix: str) -> dict[str, dict[int, tuple[str, int, bool | None]]]:
    """Of every module whose parameters peft's ParamWrappers adapt (LoRA tensors of any adapter
    beside no `<m>.base_layer.weight`, the parameters under as many `.base_layer` steps as there
    are wrappers): each wrapper level's (parameter, E, transposed), told by the shapes of its
    LoRA. Refused: a level without LoRA, a LoRA no parameter fits or several do, two levels on
    one parameter, a stack of one expert."""
    found: dict[str, dict[int, list[tuple[str, str]]]] = {}
    for (path, _), tensors in sorted(parts.items()):
        if f"{path}{BASE_LAYER}weight" in shapes or "lora_A" not in tensors or "lora_B" not in tensors:
            continue
        stem, level = wrapper_level(path)
        found.setdefault(stem, {}).setdefault(level, []).append((tensors["lora_A"], tensors["lora_B"]))
    chains: dict[str, dict[int, tuple[str, int, bool | None]]] = {}
    for stem, levels in found.items():
        inner = stem + ".base_layer" * (max(levels) + 1) + "."
        params = {n[len(inner):]: shape for n, shape in shapes.items()
                  if n.startswith(inner) and "." not in n[len(inner):]}
        if not params:  # a base folder's experts one by one: the stacks transformers makes of them
            params = stacked_shapes(unwrapped(stem), {unwrapped(n): shape for n, shape in shapes.items()
                                                      if n.startswith(inner)})
        if not params:
            continue  # no parameters under the wrappers: the caller's "no base weight"
        module, chain = unwrapped(stem), {}
        for level in range(max(levels) + 1):
            if level not in levels:
                raise CheckpointError(where, f"{prefix}{stem}{'.base_layer' * level}: a peft ParamWrapper without "
                                             "LoRA tensors (lora_A, lora_B) between others")
            (a, b), *more = levels[level]
            fits = {p: fit for p, shape in params.items()
                    if (fit := parameter_fit(shapes[a], shapes[b], shape)) is not None}
            shown = f"lora_A {list(shapes[a])} and lora_B {list(shapes[b])}"
            if not fits:
                have = ", ".join(f"{p} {list(s)}" for p, s in sorted(params.items()))
                raise CheckpointError(where, f"{prefix}{a}: {shown} fit no parameter of {module} ({have}) as peft "
                                             "shapes a ParamWrapper's LoRA (A [E·r, in], B [out, r·E])")
            if len(fits) > 1:
                raise CheckpointError(where, f"{prefix}{a}: {shown} fit {' and '.join(sorted(fits))} of {module}: "
                                             "which parameter this ParamWrapper adapts is not told by the shapes")
            (param, (experts, transposed)), = fits.items()
            if experts == 1:
                raise CheckpointError(where, f"{prefix}{a}: a LoRA on {module}.{param}, a stack of one expert "
                                             f"{list(params[param])}, which peft merges as a matrix: export-hf does "
                                             "not merge it yet")
            odd = next((x for x, y in more if parameter_fit(shapes[x], shapes[y], params[param]) is None), None)
            if odd is not None:
                raise CheckpointError(where, f"{prefix}{odd}: lora_A {list(shapes[odd])} does not fit {module}.{param}"
                                             f", which {prefix}{a} beside it adapts")
            if any(param == p for p, _, _ in chain.values()):
                raise CheckpointError(where, f"{prefix}{a}: a second peft ParamWrapper on {module}.{param}")
            chain[level] = (param, experts, transposed)
        chains[stem] = chain
    return chains


@dataclass(frozen=True)
class LoraScale:
    """α, rsLoRA, and where they were read (`--lora-alpha`, an adapter_config.json)."""

    alpha: float
    rslora: bool
    rank: int | None = None
    """The config's `r`, checked against every adapter's rank; None from the command line."""
    source: str = "--lora-alpha"
    dora: bool | None = None
    """The config's `use_dora`, checked against the tensors; None from the command line."""

    def scale(self, rank: int) -> float:
        """s as peft computes it: α / r, or α / √r with rsLoRA (Python floats)."""
        return self.alpha / math.sqrt(rank) if self.rslora else self.alpha / rank


VARIANTS = (("alora_invocation_tokens", "aLoRA: the adapter acts only after its invocation tokens"),
            ("arrow_config", "Arrow: a per-token router over LoRA experts"),
            ("kasa_config", "KaSA: the base weight truncated by SVD, a learned diagonal between B and A"))
"""peft's LoRA variants whose tensors are a plain LoRA's but whose model is not W + s · B @ A
(peft refuses to merge the first two, and truncates KaSA's base weight first): set, an adapter
config describes a model neither a merge nor a plain LoRA folder gives."""


def read_adapter_config(path: Path, unsupported: str = "export-hf does not merge") -> LoraScale:
    """α, rsLoRA, r and DoRA of a peft `adapter_config.json`. Refused: not LoRA, per-module ranks
    or alphas, fan_in_fan_out, LoRA biases, the `VARIANTS` (what the command `unsupported` says
    does none of these yet), a missing or non-numeric α or r."""
    data = read_json_object(path, "peft adapter config")
    if data.get("peft_type") != "LORA":
        raise UsageError(f"{path}: peft_type is {data.get('peft_type')!r}, not 'LORA'")
    for key, what in (("rank_pattern", "per-module ranks"), ("alpha_pattern", "per-module alphas")):
        if data.get(key):
            raise UsageError(f"{path}: has a {key} ({what}), which {unsupported} yet")
    for key, what in (("fan_in_fan_out", "transposed (Conv1D) weights"), ("lora_bias", "LoRA biases")):
        if data.get(key):
            raise UsageError(f"{path}: {key} is true ({what}), which {unsupported} yet")
    for key, what in VARIANTS:
        if data.get(key) not in (None, False, []):  # an empty sub-config ({}) is the variant at its defaults
            raise UsageError(f"{path}: {key} is set ({what}), which {unsupported} yet")
    for key in ("use_rslora", "use_dora"):  # peft reads any truthy value as true: "false" would be rsLoRA
        if data.get(key) is not None and not isinstance(data[key], bool):
            raise UsageError(f"{path}: {key} is {json.dumps(data[key])}, not true or false")
    alpha, rank = data.get("lora_alpha"), data.get("r")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise UsageError(f"{path}: lora_alpha is {json.dumps(alpha)}, not a number")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise UsageError(f"{path}: r is {json.dumps(rank)}, not a positive integer")
    return LoraScale(alpha, data.get("use_rslora") is True, rank, str(path), data.get("use_dora") is True)


def resolve_scale(alpha: float | None, rslora: bool, config: LoraScale | None, where: str | Path) -> LoraScale:
    """The one α (and rsLoRA) of the export: `--lora-alpha`/`--rslora`, the adapter config's,
    or both when they agree; neither is refused (α is never guessed)."""
    if alpha is not None and not math.isfinite(alpha):
        raise UsageError(f"--lora-alpha {alpha:g} is not a finite number")
    if config is None:
        if alpha is None:
            raise UsageError(f"{where}: LoRA α is not in the checkpoint: pass --lora-alpha (and --rslora for an "
                             f"rsLoRA run) or --adapter-config (the run's {PEFT_CONFIG})")
        return LoraScale(alpha, rslora)
    if alpha is not None and alpha != config.alpha:
        raise UsageError(f"--lora-alpha {alpha:g} disagrees with {config.source}, whose lora_alpha is "
                         f"{config.alpha:g}")
    if rslora and not config.rslora:
        raise UsageError(f"--rslora disagrees with {config.source}, whose use_rslora is false")
    return config


def check_against_config(adapters: PeftAdapters, scale: LoraScale, where: str | Path, prefix: str = "") -> None:
    """Refuse an adapter whose rank (its A's rows) is not the config's `r`, or DoRA magnitudes the
    config's `use_dora` does not have (or the reverse) (`prefix`: as in `find_adapters`)."""
    if scale.dora is not None and scale.dora != adapters.dora:
        held = "holds DoRA magnitudes" if adapters.dora else "holds no DoRA magnitude"
        raise CheckpointError(where, f"{held}, but {scale.source} says use_dora {str(scale.dora).lower()}")
    if scale.rank is None:
        return
    wrong = [a for a in adapters.adapters if a.rank != scale.rank]
    if wrong:
        more = f" (+{counted(len(wrong) - 1, 'more adapter')})" if len(wrong) > 1 else ""
        raise CheckpointError(where, f"{prefix}{wrong[0].a} has rank {wrong[0].rank} (its rows), but "
                                     f"{scale.source} says r {scale.rank}{more}")


def peft_config(adapters: PeftAdapters, scale: LoraScale, modules: Collection[str], base_model: str | None,
                task_type: str | None, parameters: Collection[str] = ()) -> dict[str, Any]:
    """An adapter_config.json PEFT loads as written. `target_modules` is the leaf names when every
    module of `modules` (the model's) with such a name is adapted, else a full-match pattern of
    the adapted ones, so PEFT puts no fresh adapter elsewhere (an empty list with LoRA on
    parameters alone: none at all, not peft's default modules of the model type);
    `target_parameters` likewise `<module leaf>.<parameter>` when every parameter of
    `parameters` (the model's tensor names) so named is adapted, else the adapted ones' full
    names, which peft matches whole; `r` the most common rank, the
    others in `rank_pattern`; `use_rslora` always (a missing one loads a wrong scale).
    `base_model` given as a model folder's config.json is written as the folder, which
    `AutoPeftModelForCausalLM` loads the base model from (a file path it cannot load)."""
    if base_model is not None and Path(base_model).name == "config.json":
        base_model = str(Path(base_model).parent)
    ranks = Counter(a.rank for a in adapters.adapters)
    rank = max(ranks, key=lambda r: (ranks[r], -r))
    adapted = {a.module for a in adapters.adapters if a.parameter is None}
    leaves = set(adapters.targets)
    every = all(m in adapted for m in modules if m.rsplit(".", 1)[-1] in leaves)
    on_parameters = {a.weight for a in adapters.adapters if a.parameter is not None}
    named = set(adapters.parameters)
    every_parameter = all(n in on_parameters for n in parameters if any(n.endswith(f".{leaf}") for leaf in named))
    target_parameters = adapters.parameters if every_parameter else sorted(on_parameters)
    alpha = int(scale.alpha) if float(scale.alpha).is_integer() else scale.alpha
    return {
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha,
        "use_rslora": scale.rslora, "use_dora": adapters.dora, "fan_in_fan_out": False, "bias": "none",
        "lora_bias": False,
        "lora_dropout": 0.0, "inference_mode": True,
        "target_modules": adapters.targets if every else "|".join(re.escape(m) for m in sorted(adapted)),
        **({"target_parameters": target_parameters} if on_parameters else {}),
        "modules_to_save": list(adapters.saved) or None,
        "rank_pattern": {a.weight if a.parameter is not None else a.module: a.rank
                         for a in adapters.adapters if a.rank != rank},
        "task_type": task_type, "base_model_name_or_path": base_model,
    }


def adapter_summary(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any] | None:
    """What `inspect` says of the peft adapters among a checkpoint's model tensors (full names),
    without judging them: kind (`peft-lora`, `peft-dora` with magnitudes), adapter names, adapted
    modules, ranks (A's rows; a ParamWrapper's over its experts), modules per leaf name (a
    parameter's as `experts.gate_up_proj`), modules trained whole (`modules_to_save`), and, with
    LoRA on expert stacks (`target_parameters`), each stack's experts; None without adapters.
    α is never in the checkpoint."""
    ranks: dict[str, int] = {}
    names: set[str] = set()
    saved: set[str] = set()
    dora = False
    for name, shape in shapes.items():
        if (copy := _SAVED.match(name)) is not None:
            names.add(copy["adapter"])
            saved.add(copy["module"])
            continue
        match = _PART.match(name)
        if match is None:
            continue
        names.add(match["adapter"])
        dora = dora or match["part"] == "lora_magnitude_vector"
        if match["part"] in ("lora_A", "lora_embedding_A") and shape:
            ranks[match["module"]] = shape[0]
    if not names:
        return None
    leaves = {m: m.rsplit(".", 1)[-1] for m in ranks}
    stacks: dict[str, int] = {}
    if any(m.endswith(".base_layer") or f"{m}{BASE_LAYER}weight" not in shapes for m in ranks):
        try:  # LoRA on parameters: which parameter each wrapper adapts, and its rank over the experts
            found = [a for n in sorted(names) if (f := find_adapters(shapes, "", chosen=n)) for a in f.adapters]
        except CheckpointError:
            found = []  # not as peft saves it: export-hf names the problem; here A's rows and the modules
        if found:
            ranks = {a.weight: a.rank for a in found}
            leaves = {a.weight: a.leaf for a in found}
            stacks = {a.leaf: a.experts for a in found if a.experts}
    summary = {"kind": "peft-dora" if dora else "peft-lora", "adapters": sorted(names), "modules": len(ranks),
               "ranks": sorted(set(ranks.values())), "targets": dict(sorted(Counter(leaves.values()).items())),
               "modules_to_save": sorted(saved)}
    if stacks:
        summary["expert_stacks"] = dict(sorted(stacks.items()))
    return summary


def summary_line(summary: Mapping[str, Any]) -> str:
    """`peft LoRA 'default': 14 modules, rank 5 (down_proj ×2, …); α is not in the checkpoint`."""
    kind = "peft DoRA" if summary["kind"] == "peft-dora" else "peft LoRA"
    targets = ", ".join(f"{leaf} ×{count}" for leaf, count in summary["targets"].items())
    saved = f"; {', '.join(summary['modules_to_save'])} trained whole" if summary["modules_to_save"] else ""
    stacks = summary.get("expert_stacks") or {}
    if stacks:
        each = ", ".join(f"{leaf} of {counted(e, 'expert')}" for leaf, e in stacks.items())
        saved += f"; LoRA on expert stacks (peft target_parameters): {each}"
    return (f"{kind} {', '.join(repr(n) for n in summary['adapters'])}: {counted(summary['modules'], 'module')}, "
            f"rank {', '.join(map(str, summary['ranks']))} ({targets}){saved}; α is not in the checkpoint (export-hf "
            "--merge-adapters or --adapter-only take --lora-alpha or --adapter-config)")
