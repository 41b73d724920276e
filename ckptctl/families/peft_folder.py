"""A PEFT LoRA adapter folder beside a base model, named as the peft model's state dict names it.

`import-hf --adapter` writes what FSDP2 saves for `get_peft_model(model, LoraConfig(...))`: the
base model's tensors under `base_model.model.`, an adapted module's own parameters as
`<m>.base_layer.<param>`, the folder's `<m>.lora_A.weight` / `lora_B.weight` as
`<m>.lora_A.<adapter>.weight` …, DoRA's `<m>.lora_magnitude_vector` as
`<m>.lora_magnitude_vector.<adapter>.weight`, an embedding's `lora_embedding_A` as
`lora_embedding_A.<adapter>`, and a `modules_to_save` module twice: its base parameters as
`<m>.original_module.<param>` and the folder's trained copy (`<m>.<param>`) as
`<m>.modules_to_save.<adapter>.<param>`. peft's `save_pretrained` also saves an adapted
embedding's own weight (`<m>.base_layer.weight`), which `PeftModel.from_pretrained` loads over
the base's: so does the import.

LoRA on parameters (`target_parameters`: peft's ParamWrapper on a fused MoE expert stack,
`families.adapters`) is named as peft nests its wrappers: the folder's `<m>.lora_A.weight` (the
outermost wrapper) and `<m>.base_layer.lora_A.weight` (the next) keep their `.base_layer` steps,
and every parameter of `<m>` goes under as many steps as `<m>` has wrappers. Which parameter each
wrapper adapts is told by its shapes; peft nests them in the order the module registers its
parameters (the first innermost), which the import checks against transformers' model when the
name check gives that order.

Closed world: the modules `adapter_config.json` adapts (matched as peft matches them: a
`target_modules` list by whole trailing components, a string as peft's full match, accepted
only as `|`-joined literal names, so no pattern from a file is ever run) must be exactly those
the folder holds adapters for; every adapter must pair with a base weight at the config's `r`;
every tensor of the folder must have its place. Pure: names and shapes in, names out.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Collection, Mapping

from ckptctl.families.adapters import PEFT_PREFIX, LoraScale, parameter_fit, read_adapter_config, wrapper_level
from ckptctl.families.expected import ExpectedNames
from ckptctl.storage.hf_files import read_json_object
from ckptctl.util.errors import CheckpointError, UsageError
from ckptctl.util.wording import counted

UNSUPPORTED_KEYS = ("layers_to_transform", "layers_pattern", "exclude_modules", "trainable_token_indices",
                    "layer_replication", "use_qalora", "use_bdlora")
"""adapter_config.json keys that change which modules peft adapts, or what it adds to them, in
ways import-hf does not follow yet: set, they are refused rather than half-followed (as are the
LoRA variants `read_adapter_config` refuses)."""
_LITERAL = re.compile(r"(?:\\.|[^.^$*+?{}\[\]()\\|])+")
"""One alternative of a `target_modules` string that is a literal name (`re.escape`d or plain)."""
_FOLDER_PART = re.compile(r"^(?P<module>.+)\.(?:(?P<lora>lora_A|lora_B)\.weight|(?P<bare>lora_magnitude_vector|"
                          r"lora_embedding_A|lora_embedding_B)|base_layer\.(?P<param>.+))$")
"""A LoRA tensor of a PEFT folder (`save_pretrained` names it without the adapter name), or an
adapted module's own parameter saved beside it."""


@dataclass(frozen=True)
class AdapterFolderConfig:
    """What an adapter_config.json says about the modules peft builds adapters on."""

    scale: LoraScale
    targets: tuple[str, ...] | None
    """`target_modules` as a list of trailing names; None when it is a string (`literals`)."""
    literals: frozenset[str] | None
    """`target_modules` given as a string of `|`-joined literal names: matched whole."""
    saved: tuple[str, ...]
    """`modules_to_save`: modules peft trains whole (matched by name ending, as peft does)."""
    path: Path
    parameters: tuple[str, ...] = ()
    """`target_parameters`: parameters peft wraps (`mlp.experts.gate_up_proj`), matched whole or
    by a dotted tail, as peft matches them."""

    def adapts(self, module: str) -> bool:
        """Whether peft puts a LoRA on `module` (a module holding a weight of its own): the module
        or a dotted tail of it in the list (`key.endswith("." + t)`), looked up tail by tail, so
        the time is the name's, whatever the list's length."""
        if self.literals is not None:
            return module in self.literals
        parts = module.split(".")
        return any(".".join(parts[i:]) in self._targets for i in range(len(parts)))

    def wraps(self, parameter: str) -> bool:
        """Whether peft puts a ParamWrapper on `parameter` (`key in targets or key.endswith("." + t)`)."""
        parts = parameter.split(".")
        return any(".".join(parts[i:]) in self._parameters for i in range(len(parts)))

    def saves(self, module: str) -> bool:
        """Whether peft trains `module` whole: its name ends with an entry (`key.endswith(t)`, no dot)."""
        return any(module[i:] in self._saved for i in range(len(module)))

    @cached_property
    def _targets(self) -> frozenset[str]:
        return frozenset(self.targets or ())

    @cached_property
    def _saved(self) -> frozenset[str]:
        return frozenset(self.saved)

    @cached_property
    def _parameters(self) -> frozenset[str]:
        return frozenset(self.parameters)


def read_folder_config(path: Path, unsupported: str = "import-hf does not import") -> AdapterFolderConfig:
    """α, r, DoRA and rsLoRA (`read_adapter_config`), and the modules adapted and trained whole;
    refused: a target_modules string that is a pattern, `all-linear`, keys of `UNSUPPORTED_KEYS`
    (which the command `unsupported` says it does not follow yet)."""
    scale = read_adapter_config(path, unsupported)
    data = read_json_object(path, "peft adapter config")
    for key in UNSUPPORTED_KEYS:
        if data.get(key) not in (None, False, []):  # an empty sub-config ({}) is peft's variant at its defaults
            raise UsageError(f"{path}: {key} is {json.dumps(data[key])}, which {unsupported} yet")
    parameters = data.get("target_parameters") or []
    if not (isinstance(parameters, list) and all(isinstance(t, str) and "." in t.strip(".") for t in parameters)):
        raise UsageError(f"{path}: target_parameters is {json.dumps(parameters)}, not a list of parameter names "
                         "(<module>.<parameter>)")
    for key, what in (("lora_dropout", "dropout"), ("use_dora", "DoRA")):
        if parameters and data.get(key):
            raise UsageError(f"{path}: {key} is {json.dumps(data[key])} beside target_parameters: peft's "
                             f"ParamWrapper has no {what}, and get_peft_model refuses it")
    targets = data.get("target_modules")
    literals = None
    if targets is None and parameters:
        raise UsageError(f"{path}: target_modules is null beside target_parameters: peft then adapts its default "
                         "modules for the model type, which import-hf does not guess ([] adapts none)")
    if isinstance(targets, str):
        if targets == "all-linear":
            raise UsageError(f"{path}: target_modules is 'all-linear', which import-hf does not expand yet: name "
                             "the modules")
        pieces = _alternatives(targets)
        if pieces is None:
            raise UsageError(f"{path}: target_modules is the pattern {json.dumps(targets)}; import-hf matches a list "
                             "of names or |-joined literal names (it runs no pattern from a file)")
        literals, targets = frozenset(pieces), None
    elif not (isinstance(targets, list) and (targets or parameters)
              and all(isinstance(t, str) and t for t in targets)):
        raise UsageError(f"{path}: target_modules is {json.dumps(targets)}, not a list of module names")
    saved = data.get("modules_to_save") or []
    if not (isinstance(saved, list) and all(isinstance(t, str) and t for t in saved)):
        raise UsageError(f"{path}: modules_to_save is {json.dumps(saved)}, not a list of module names")
    return AdapterFolderConfig(scale, tuple(targets) if targets is not None else None, literals, tuple(saved), path,
                               tuple(parameters))


def _alternatives(pattern: str) -> list[str] | None:
    """The names a `|`-joined string of literal names matches whole, or None when some part is a pattern."""
    pieces = re.split(r"(?<!\\)\|", pattern)
    if not all(_LITERAL.fullmatch(p) for p in pieces):
        return None
    return [re.sub(r"\\(.)", r"\1", p) for p in pieces]


@dataclass(frozen=True)
class PeftModelNames:
    """Where each tensor of the peft model's state dict comes from."""

    base: dict[str, str]
    """Base model tensor → its name in the peft model (those the folder overrides left out)."""
    folder: dict[str, str]
    """Folder tensor → its name in the peft model."""
    adapted: tuple[str, ...]
    """The modules with a LoRA, sorted."""
    saved: tuple[str, ...]
    """The modules trained whole (`modules_to_save`), sorted."""
    rank: int


def _module_of(name: str, modules: Collection[str]) -> tuple[str, str] | None:
    """(module, rest) for the nearest enclosing module of `modules` holding parameter `name`."""
    parts = name.split(".")
    for at in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:at])
        if module in modules:
            return module, ".".join(parts[at:])
    return None


def peft_model_names(base: Mapping[str, tuple[int, ...]], folder: Mapping[str, tuple[int, ...]],
                     config: AdapterFolderConfig, adapter_name: str, where: str | Path,
                     model: ExpectedNames | None = None) -> PeftModelNames:
    """The peft model's names for the base model's tensors (`base`, HF names as the model holds
    them) and the adapter folder's (`folder`, PEFT's saved names), adapter `adapter_name`;
    refused with one line (naming `where`, the folder's weights file): an adapter on a module the
    base has no weight for, a rank or shape that does not pair with it or differs from the
    config's `r`, DoRA magnitudes against the config's `use_dora`, a module the config adapts with
    no adapter in the folder (or the reverse), a modules_to_save module's parameter missing, and
    any folder tensor with no place; LoRA on parameters as `_check_wrappers` says (`model`:
    transformers' model of the base, when the name check asked it)."""
    if not re.fullmatch(r"[^.\s]+", adapter_name):
        raise UsageError(f"--adapter-name {adapter_name!r} is no peft adapter name (one word, no dot)")
    peft_named = sorted(n for n in base if n.startswith(PEFT_PREFIX))
    if peft_named:
        raise CheckpointError(where, f"the base model already has peft's names ({peft_named[0]}): import the base "
                                     "model's own folder")
    owners = {n.rsplit(".", 1)[0] for n in base if "." in n}
    modules = {".".join(n.split(".")[:i]) for n in owners for i in range(1, n.count(".") + 2)}
    saved = {m for m in modules if config.saves(m)}
    nested = sorted(m for m in saved if _module_of(m, saved) is not None)  # inside another
    if nested:
        raise UsageError(f"{config.path}: modules_to_save matches {nested[0]} and a module holding it: which one "
                         "peft trains whole is not guessed")
    parts, overrides, copies = _folder_parts(folder, saved, config, where)
    if not parts:
        raise CheckpointError(where, "holds no LoRA adapter (no <m>.lora_A.weight)")
    wrapped = {n.rsplit(".", 1)[0] for n in base if config.wraps(n)}  # modules whose parameters peft wraps
    stems = {wrapper_level(path)[0] for path in parts} & wrapped
    on_parameters = {path: found for path, found in parts.items() if wrapper_level(path)[0] in stems}
    parts = {path: found for path, found in parts.items() if path not in on_parameters}
    _check_adapters(parts, base, folder, saved, config, where)
    wrappers = {module: 1 for module in parts}
    wrappers.update(_check_wrappers(on_parameters, base, folder, config, where, model))
    parts.update(on_parameters)
    names: dict[str, str] = {}
    for name in base:
        if (lora := _module_of(name, wrappers)) is not None:
            names[name] = f"{PEFT_PREFIX}{lora[0]}{'.base_layer' * wrappers[lora[0]]}.{lora[1]}"
        elif (whole := _module_of(name, saved)) is not None:
            names[name] = f"{PEFT_PREFIX}{whole[0]}.original_module.{whole[1]}"
        else:
            names[name] = PEFT_PREFIX + name
    lacking = sorted(n for n in base if _module_of(n, saved) and n not in copies)
    if lacking:
        raise CheckpointError(where, f"has no {PEFT_PREFIX}{lacking[0]}, the trained copy of a modules_to_save "
                                     f"module ({config.path.name} names {', '.join(config.saved)})")
    folder_names: dict[str, str] = {}
    for inner, name in sorted(copies.items()):
        if inner not in base or folder[name] != base[inner]:
            what = f"is {list(folder[name])}, the base's {list(base[inner])}" if inner in base else \
                "is no parameter of the base model's module"
            raise CheckpointError(where, f"{name} (modules_to_save) {what}")
        module, rest = _module_of(inner, saved)
        folder_names[name] = f"{PEFT_PREFIX}{module}.modules_to_save.{adapter_name}.{rest}"
    for inner, name in sorted(overrides.items()):  # an adapted embedding's weight, which peft saves and loads
        if _module_of(inner, wrappers) is None or inner not in base or folder[name] != base[inner]:
            raise CheckpointError(where, f"{name}: an adapted module's own parameter, beside no adapter of that "
                                         "module or of another shape than the base's")
        folder_names[name] = names.pop(inner)
    for module, found in parts.items():
        for part, name in found.items():
            leaf = f"{part}.{adapter_name}" if part.startswith("lora_embedding") else f"{part}.{adapter_name}.weight"
            folder_names[name] = f"{PEFT_PREFIX}{module}.{leaf}"
    return PeftModelNames(names, folder_names, tuple(sorted(parts)), tuple(sorted(saved)), config.scale.rank or 0)


def _check_wrappers(parts: Mapping[str, Mapping[str, str]], base: Mapping[str, tuple[int, ...]],
                    folder: Mapping[str, tuple[int, ...]], config: AdapterFolderConfig, where: str | Path,
                    model: ExpectedNames | None) -> dict[str, int]:
    """Each module whose parameters the config's `target_parameters` wraps → its wrappers, one per
    wrapped parameter: the folder's LoRA at `<m>` (the outermost), `<m>.base_layer` (the next) …
    each fitting one wrapped parameter as peft shapes a ParamWrapper's (A [E·r, in], B [out, r·E])
    at the config's r, no two on one parameter; where transformers' `model` is known, nested as
    peft nests them (the parameter the module registers first innermost) and shaped for the
    stack's orientation (`is_transposed`: peft before 0.19.1 shaped them otherwise,
    huggingface/peft#3165, and this peft would not load them). Refused: a wrapped
    parameter without its adapter here (peft would start it fresh), a level missing or holding
    other tensors, shapes no parameter or several fit."""
    levels: dict[str, dict[int, Mapping[str, str]]] = {}
    for path, found in parts.items():
        stem, level = wrapper_level(path)
        levels.setdefault(stem, {})[level] = found
    position = {name: i for i, name in enumerate(model.shapes if model is not None else ())}
    wrappers: dict[str, int] = {}
    for stem, found in sorted(levels.items()):
        params = {n[len(stem) + 1:]: base[n] for n in base
                  if n.startswith(f"{stem}.") and "." not in n[len(stem) + 1:] and config.wraps(n)}
        depth = len(params)
        first = next(iter(found[min(found)].values()))
        if sorted(found) != list(range(depth)):
            lacking = next((lv for lv in range(depth) if lv not in found), None)
            what = (f"has no LoRA at {PEFT_PREFIX}{stem}{'.base_layer' * lacking}.lora_A.weight" if lacking is not None
                    else f"holds LoRA at {len(found)} wrapper levels")
            raise CheckpointError(where, f"{first}: {config.path.name}'s target_parameters wrap "
                                         f"{counted(depth, 'parameter')} of {stem} ({', '.join(sorted(params))}), "
                                         f"but the folder {what}")
        taken: dict[str, int] = {}
        for level, tensors in sorted(found.items()):
            first = next(iter(tensors.values()))
            if set(tensors) != {"lora_A", "lora_B"}:
                extra = sorted(set(tensors) - {"lora_A", "lora_B"})
                why = f"beside {extra[0]}, which peft's ParamWrapper has not" if extra else "has no lora_B beside it"
                raise CheckpointError(where, f"{first}: {why}")
            sa, sb = folder[tensors["lora_A"]], folder[tensors["lora_B"]]
            fits = {p: fit for p, shape in params.items() if (fit := parameter_fit(sa, sb, shape)) is not None}
            if len(fits) != 1:
                have = ", ".join(f"{p} {list(s)}" for p, s in sorted(params.items()))
                raise CheckpointError(where, f"{tensors['lora_A']}: lora_A {list(sa)} and lora_B {list(sb)} fit "
                                             f"{'no parameter' if not fits else ' and '.join(sorted(fits))} of {stem} "
                                             f"({have}) as peft shapes a ParamWrapper's LoRA (A [E·r, in], "
                                             "B [out, r·E])")
            (param, (experts, transposed)), = fits.items()
            held = model is not None and f"{stem}.{param}" in model.transposed
            if experts and model is not None and transposed is not None and transposed != held:
                shaped, holds = ("out, in", "in, out") if held else ("in, out", "out, in")
                raise CheckpointError(where, f"{tensors['lora_A']}: lora_A {list(sa)} and lora_B {list(sb)} are "
                                             f"shaped for {stem}.{param} held as [E, {shaped}], but a "
                                             f"{model.model_class} holds it as [E, {holds}] (a LoRA of peft before "
                                             "0.19.1, huggingface/peft#3165?)")
            if param in taken:
                raise CheckpointError(where, f"{tensors['lora_A']}: a second LoRA on {stem}.{param}")
            if sa[0] != config.scale.rank * max(experts, 1):
                raise CheckpointError(where, f"{tensors['lora_A']} has rank {sa[0] // max(experts, 1)} (its rows over "
                                             f"{counted(max(experts, 1), 'expert')}), but {config.path} says r "
                                             f"{config.scale.rank}")
            taken[param] = level
        if model is not None:  # peft nests them as the module registers them: the first innermost
            registered = sorted(params, key=lambda p: position.get(f"{stem}.{p}", len(position)))
            if any(taken[p] != depth - 1 - i for i, p in enumerate(registered)):
                raise CheckpointError(where, f"{first}: the folder nests the LoRA of {stem} as "
                                             f"{' in '.join(sorted(taken, key=taken.get))}, but peft nests them as the "
                                             f"model registers them: {' in '.join(reversed(registered))}")
        wrappers[stem] = depth
    unwrapped = sorted(n for n in base if config.wraps(n) and n.rsplit(".", 1)[0] not in wrappers)
    if unwrapped:
        more = f" (+{counted(len(unwrapped) - 1, 'more parameter')})" if len(unwrapped) > 1 else ""
        raise CheckpointError(where, f"{config.path.name}'s target_parameters wrap {unwrapped[0]}{more}, which has no "
                                     "adapter here: peft would start it fresh")
    return wrappers


def _folder_parts(folder: Mapping[str, tuple[int, ...]], saved: set[str], config: AdapterFolderConfig,
                  where: str | Path) -> tuple[dict[str, dict[str, str]], dict[str, str], dict[str, str]]:
    """The folder's tensors sorted by what they are: each adapted module's LoRA parts (part →
    name), adapted modules' own parameters (HF name → name), modules_to_save copies (HF name →
    name); any other is refused."""
    parts: dict[str, dict[str, str]] = {}
    overrides: dict[str, str] = {}
    copies: dict[str, str] = {}
    for name in sorted(folder):
        if not name.startswith(PEFT_PREFIX):
            raise CheckpointError(where, f"{name}: not under {PEFT_PREFIX}, as PEFT's save_pretrained names every "
                                         "tensor")
        inner = name[len(PEFT_PREFIX):]
        match = _FOLDER_PART.match(inner)
        if match is not None and match["param"] is not None:
            overrides[f"{match['module']}.{match['param']}"] = name
        elif match is not None:
            parts.setdefault(match["module"], {})[match["lora"] or match["bare"]] = name
        elif _module_of(inner, saved) is not None:
            copies[inner] = name
        else:
            raise CheckpointError(where, f"{name}: neither a LoRA tensor nor a parameter of a modules_to_save module "
                                         f"of {config.path.name}: it has no place in the peft model")
    return parts, overrides, copies


def _check_adapters(parts: Mapping[str, Mapping[str, str]], base: Mapping[str, tuple[int, ...]],
                    folder: Mapping[str, tuple[int, ...]], saved: set[str], config: AdapterFolderConfig,
                    where: str | Path) -> None:
    """Each adapter on a base weight the config adapts, paired with it at the config's r, with DoRA
    magnitudes as the config says; and every module the config adapts with its adapter here."""
    rank = config.scale.rank
    firsts = {m: found.get("lora_A", found.get("lora_embedding_A")) for m, found in parts.items()}
    off_rank = [m for m, a in firsts.items() if a is not None and folder[a][:1] != (rank,)]
    for module, found in sorted(parts.items()):
        first = next(iter(found.values()))
        if f"{module}.weight" not in base:
            raise CheckpointError(where, f"{first}: an adapter on {module}, but the base model has no {module}.weight "
                                         "(is the adapter this model's?)")
        if not config.adapts(module):
            raise CheckpointError(where, f"{first}: an adapter on {module}, which {config.path.name}'s target_modules "
                                         "does not name: peft would not load it")
        if _module_of(f"{module}.weight", saved) is not None:
            raise CheckpointError(where, f"{first}: an adapter on {module}, which modules_to_save trains whole")
        embedding = "lora_embedding_A" in found or "lora_embedding_B" in found
        pair = ("lora_embedding_A", "lora_embedding_B") if embedding else ("lora_A", "lora_B")
        missing = [p for p in pair if p not in found]
        if missing:
            raise CheckpointError(where, f"{first} has no {missing[0]} beside it")
        if set(found) - {*pair, "lora_magnitude_vector"}:
            raise CheckpointError(where, f"{first}: beside {sorted(set(found) - set(pair))[0]}")
        w, sa, sb = base[f"{module}.weight"], folder[found[pair[0]]], folder[found[pair[1]]]
        rows, cols = (w[1], w[0]) if embedding and len(w) == 2 else (w[0], w[-1])
        if len(w) != 2 or len(sa) != 2 or len(sb) != 2 or sa[1] != cols or sb[0] != rows or sa[0] != sb[1]:
            raise CheckpointError(where, f"{PEFT_PREFIX}{module}: {pair[0]} {list(sa)} and {pair[1]} {list(sb)} do not "
                                         f"pair with its base weight {list(w)} (want [r, {cols}] and [{rows}, r])")
        if sa[0] != rank:
            also = f" (+{counted(len(off_rank) - 1, 'more adapter')})" if len(off_rank) > 1 else ""
            raise CheckpointError(where, f"{found[pair[0]]} has rank {sa[0]} (its rows), but {config.path} says r "
                                         f"{rank}{also}")
        magnitude = found.get("lora_magnitude_vector")
        if magnitude is not None and embedding:
            raise CheckpointError(where, f"{magnitude}: DoRA on an embedding, which import-hf does not import yet")
        if (magnitude is not None) != bool(config.scale.dora):
            held = f"holds DoRA magnitudes ({magnitude})" if magnitude else "holds no DoRA magnitude"
            raise CheckpointError(where, f"{PEFT_PREFIX}{module} {held}, but {config.path} says use_dora "
                                         f"{str(bool(config.scale.dora)).lower()}")
        if magnitude is not None and folder[magnitude] != (w[0],):
            raise CheckpointError(where, f"{magnitude}: DoRA magnitude {list(folder[magnitude])}, not [{w[0]}] as its "
                                         "base weight's rows")
    weighted = (n[:-len(".weight")] for n in base if n.endswith(".weight"))
    unadapted = sorted(m for m in weighted
                       if config.adapts(m) and m not in parts and _module_of(f"{m}.weight", saved) is None)
    if unadapted:
        more = f" (+{counted(len(unadapted) - 1, 'more module')})" if len(unadapted) > 1 else ""
        raise CheckpointError(where, f"{config.path.name}'s target_modules adapt {unadapted[0]}{more}, which has no "
                                     "adapter here: peft would start it fresh")
