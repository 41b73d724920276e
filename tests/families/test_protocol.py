"""Every registered family answers the whole `ModelFamily` interface, so no caller asks its kind."""

from ckptctl.families.protocol import ModelFamily, Naming
from ckptctl.families.registry import FAMILIES

MEMBERS = sorted({*ModelFamily.__annotations__, *(n for n in vars(ModelFamily) if not n.startswith("_"))})


def test_every_family_has_every_member_of_the_protocol():
    assert {"name", "naming", "to_hf", "mtp_prefixes", "megatron_tensors", "gated_mlp"} <= set(MEMBERS)
    for family in FAMILIES.values():
        assert [m for m in MEMBERS if not hasattr(family, m)] == [], family.name


def test_only_megatron_families_answer_megatron_questions():
    for family in FAMILIES.values():
        megatron = family.naming is Naming.MEGATRON
        assert bool(list(family.megatron_tensors())) == megatron, family.name
        assert (family.gated_mlp() is not None) == megatron, family.name
        assert bool(family.model_types) == (family.naming is not Naming.HF), family.name
