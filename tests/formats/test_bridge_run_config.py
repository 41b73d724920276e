"""A Megatron-Bridge run's LoRA settings, read from the run_config.yaml its checkpoint holds.

The files are what Bridge's `ConfigContainer.to_yaml` writes (`run_config_yaml`: the PEFT
dataclass's fields and defaults read from Bridge's own source); hostile or foreign ones are
refused with one line naming the file, and nothing in them is ever constructed.
"""

from __future__ import annotations

import importlib.util

import pytest

from ckptctl.formats.bridge_run_config import BridgePeft, read_bridge_peft, run_config_path
from ckptctl.util.errors import CheckpointError
from tests.families.test_bridge_adapters import run_config_yaml

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron.bridge") is None,
                                reason="Megatron-Bridge is not installed (make oracles)")


def test_lora_and_canonical_lora_settings_are_read(tmp_path):
    assert run_config_path(tmp_path) is None
    path = tmp_path / "run_config.yaml"
    path.write_text(run_config_yaml(alpha=16, dim=8))
    assert run_config_path(tmp_path) == path
    assert read_bridge_peft(path) == BridgePeft(path, "lora", 16, 8, ("linear_qkv", "linear_proj", "linear_fc1",
                                                                      "linear_fc2"), False)
    path.write_text(run_config_yaml("canonical-lora", lora_dtype=None, alpha=0.5, dim=4, normalize_moe_lora=True))
    assert read_bridge_peft(path) == BridgePeft(path, "canonical-lora", 0.5, 4, (
        "linear_q", "linear_k", "linear_v", "linear_proj", "linear_fc1_up", "linear_fc1_gate", "linear_fc2"), True)


@pytest.mark.parametrize(("text", "reason"), [
    (run_config_yaml("dora", alpha=8, dim=4), "peft._target_ is 'megatron.bridge.peft.dora.DoRA', which export-hf "
                                              "does not merge (it merges megatron.bridge.peft.lora.LoRA and "
                                              "megatron.bridge.peft.canonical_lora.CanonicalLoRA)"),
    ("peft: null\nmodel: {}\n", "peft is null: the run trained no adapters, yet the checkpoint holds Megatron-Bridge "
                                "LoRA adapters"),
    ("model: {}\n", "peft is null: the run trained no adapters, yet the checkpoint holds Megatron-Bridge LoRA "
                    "adapters"),
    ("peft: !!python/object/apply:os.system ['touch pwned']\n",
     "not a readable run config (could not determine a constructor for the tag "
     "'tag:yaml.org,2002:python/object/apply:os.system' at line 1)"),
    ("- a\n- b\n", "not a YAML mapping (is this a Megatron-Bridge run_config.yaml?)"),
    ("peft: [1, 2]\n", "peft is [1, 2], not a mapping"),
    ("peft: {a: [}\n", "not a readable run config (did not find expected node content at line 1)"),
    (run_config_yaml(alpha="eight", dim=4), "peft.alpha is 'eight', not a finite number"),
    (run_config_yaml(alpha=True, dim=4), "peft.alpha is True, not a finite number"),
    (run_config_yaml(alpha=float("inf"), dim=4), "peft.alpha is inf, not a finite number"),
    (run_config_yaml(alpha=8, dim=0), "peft.dim is 0, not a positive integer"),
    (run_config_yaml(alpha=8, dim=4.0), "peft.dim is 4.0, not a positive integer"),
    (run_config_yaml(alpha=8, dim=4, target_modules="linear_qkv"), "peft.target_modules is 'linear_qkv', not a list "
                                                                   "of names"),
    (run_config_yaml(alpha=8, dim=4, normalize_moe_lora="yes"), "peft.normalize_moe_lora is 'yes', not true or false"),
])
def test_foreign_or_hostile_run_configs_are_refused(tmp_path, text, reason):
    path = tmp_path / "run_config.yaml"
    path.write_text(text)
    with pytest.raises(CheckpointError) as err:
        read_bridge_peft(path)
    assert str(err.value) == f"{path}: {reason}"
    assert not (tmp_path / "pwned").exists()


LORA = "_target_: megatron.bridge.peft.lora.LoRA"
BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi"))
"""Aliases a loader keeps as shared references (9 lines) that a repr writes out whole: 9⁹ strings."""
SHOWN_BOMB = "[[[[[...], [...], [...], [...], ...], [[...], [...], [...], [...], ...], [[....."
"""Its first 77 characters, four levels and four items each deep, as a message shows it."""


@pytest.mark.parametrize(("text", "reason"), [
    (f"peft: {{{LORA}, alpha: {'9' * 400}, dim: 8}}\n", "peft.alpha is <an integer of 1329 bits>, not a finite number"),
    (f"peft: {{{LORA}, alpha: 0x{'f' * 20_000}, dim: 8}}\n",
     "peft.alpha is <an integer of 80000 bits>, not a finite number"),
    (f"peft: {{{LORA}, alpha: 3, dim: {'9' * 5000}}}\n",
     "not a readable run config (Exceeds the limit (4300 digits) for integer string conversion)"),
    (f"{BOMB}peft: *i\n", f"peft is {SHOWN_BOMB}, not a mapping"),
    (f"{BOMB}peft: {{{LORA}, alpha: *i, dim: 8}}\n", f"peft.alpha is {SHOWN_BOMB}, not a finite number"),
    (f"{BOMB}peft: {{{LORA}, alpha: 8, dim: 8, target_modules: *i}}\n",
     f"peft.target_modules is {SHOWN_BOMB}, not a list of names"),
])
def test_numbers_too_large_and_alias_bombs_are_one_line_at_once(tmp_path, text, reason):
    """A run config's values are shown bounded: an integer too large for a float (it was an
    OverflowError traceback; a decimal one past Python's 4,300 digits a ValueError), and nested
    aliases whose repr is exponential (it hung, memory growing), each one line in well under a second."""
    import time

    path = tmp_path / "run_config.yaml"
    path.write_text(text)
    started = time.perf_counter()
    with pytest.raises(CheckpointError) as err:
        read_bridge_peft(path)
    assert str(err.value) == f"{path}: {reason}"
    assert time.perf_counter() - started < 1


def test_a_deeply_nested_run_config_is_refused(tmp_path):
    """libyaml stops at its nesting limit, the Python loader at the recursion limit: one line either way."""
    path = tmp_path / "run_config.yaml"
    path.write_text("peft: " + "[" * 100_000)
    with pytest.raises(CheckpointError) as err:
        read_bridge_peft(path)
    assert str(err.value).startswith(f"{path}: not a readable run config (")


def test_a_huge_run_config_is_refused_unread(tmp_path):
    path = tmp_path / "run_config.yaml"
    with open(path, "wb") as f:
        f.truncate((8 << 20) + 1)
    with pytest.raises(CheckpointError) as err:
        read_bridge_peft(path)
    assert "implausibly large" in str(err.value) or "over" in str(err.value)
