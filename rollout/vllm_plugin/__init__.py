"""vLLM out-of-tree model plugin: serves `MarathonForCausalLM` (model_type "marathon") in vLLM.

vLLM calls `register()` in every process it starts (entry point group ``vllm.general_plugins``, name
``marathon``, declared in pyproject.toml). It registers our HF config with transformers' AutoConfig (vLLM parses
config.json through it) and the model classes with vLLM's ModelRegistry (lazy string form: vLLM imports the
model module only when it builds the model). Checkpoints name "MarathonForCausalLM" (hybrid); a layout
without linear layers is served as "MarathonAttnForCausalLM" (`model.serving_architecture`).
"""

from __future__ import annotations

ARCHITECTURES = ("MarathonForCausalLM", "MarathonAttnForCausalLM")  # hybrid / layouts without L layers


def register() -> None:
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from model.config import MarathonConfig

    AutoConfig.register("marathon", MarathonConfig, exist_ok=True)
    for arch in ARCHITECTURES:
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, f"rollout.vllm_plugin.model:{arch}")
