"""Marathon's hybrid-attention MoE transformer, registered with transformers' Auto classes
(``AutoConfig`` model_type "marathon", ``AutoModelForCausalLM``)."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from model.cache import MarathonCache
from model.config import PRESETS, MarathonConfig
from model.modeling import MarathonForCausalLM, MarathonModel

AutoConfig.register("marathon", MarathonConfig, exist_ok=True)
AutoModel.register(MarathonConfig, MarathonModel, exist_ok=True)
AutoModelForCausalLM.register(MarathonConfig, MarathonForCausalLM, exist_ok=True)

__all__ = ["PRESETS", "MarathonCache", "MarathonConfig", "MarathonForCausalLM", "MarathonModel"]
