"""Example Marathon environment plugin (see README.md)."""

import envs

ENV_ID = "marathon-example/Inventory-v0"


def register() -> None:
    """Entry point of the ``marathon.envs`` group: register this package's environments."""
    envs.register(ENV_ID, entry_point="marathon_env_example.inventory:InventoryEnv")
