"""Moved to ``learner.dist`` (the learner must not import the CLI package); re-exported for tools and scripts."""

from learner.dist import free_port as _free_port  # noqa: F401
from learner.dist import init_distributed, init_single_process_group  # noqa: F401
