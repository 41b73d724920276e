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
