"""Marathon: the CLI and the driver that wires rollout/, learner/, envs/ and rewards/ together."""

__version__ = "0.1.0"
