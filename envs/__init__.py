"""Multi-round tool-calling text environments (contract: ``envs/base.py``; guide: ``envs/README.md``)."""

from envs.base import ToolEnv
from envs.config_tools import SpecError
from envs.registry import UnknownEnvError, list_envs, load_plugins, make, register
from envs.seeds import heldout_seeds, train_seeds
from envs.tools import Tool, ToolError, ToolTimeout

__all__ = [
    "SpecError",
    "Tool",
    "ToolEnv",
    "ToolError",
    "ToolTimeout",
    "UnknownEnvError",
    "heldout_seeds",
    "list_envs",
    "load_plugins",
    "make",
    "register",
    "train_seeds",
]
