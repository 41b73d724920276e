"""Red team: NeMo Automodel PEFT step folders that are something else too.

A step folder (`model/` a PEFT folder marked by `automodel_peft_config.json`) holding a DCP
checkpoint of its own (`.metadata` at its root) was taken by inspect and export-hf as the Automodel
save (export-hf merged `model/`'s adapters into `--hf-config`'s weights, exit 0) and by reshard as
the DCP checkpoint: which one the user means is not known, so the Automodel readers refuse it.
"""

from __future__ import annotations

import json

import torch

from tests.conftest import run_cli


def test_a_step_folder_that_is_also_a_dcp_checkpoint_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    step = tmp_path / "epoch_0_step_1"
    dcp.save({"model": {"w": torch.arange(12.0).reshape(4, 3)}}, checkpoint_id=step, no_dist=True)
    (step / "model").mkdir()
    (step / "model" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                                                    "target_modules": ["q_proj"]}))
    (step / "model" / "automodel_peft_config.json").write_text("{}")
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text(json.dumps({"model_type": "llama",
                                                               "architectures": ["LlamaForCausalLM"]}))
    line = (f"ckptctl: error: {step}: both a DCP checkpoint (its own .metadata) and a NeMo Automodel PEFT save "
            "(model/ a PEFT folder): which one is meant is not known; move one of them to a folder of its own\n")
    export = ("export-hf", step, tmp_path / "out", "--hf-config", tmp_path / "base", "--merge-adapters")
    for args in (("inspect", step), export):
        res = run_cli(*args)
        assert (res.returncode, res.stderr) == (2, line), args
    assert not (tmp_path / "out").exists()
