"""A sixth model family, in tests only: the dense native decoder renamed `stub_llama`, built from a Hugging Face
Llama folder alone (`model.hf_path`: its config.json read, its weights loaded).

It proves the family seam: a config registers it with `custom_imports = dict(imports=["stub_family"])` and trains
it, and nothing under engine/, planner/ or config/ names it (tests/e2e/test_model_family_e2e.py). Its
capabilities are the defaults: every feature that needs one refuses it in one line.
"""

from internlm_offload.family import Capabilities, FamilySpec, register_family

FAMILY = register_family(
    FamilySpec(
        name="stub_llama",
        entry="stub_family.build",
        summary="the dense decoder from a Hugging Face Llama folder (tests only)",
        capabilities=Capabilities(),
    )
)
