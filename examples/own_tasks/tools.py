"""The tool of the example task: a phone-directory lookup. A plain function: its JSON schema comes from the
signature and this docstring. ``directory`` is filled from each task row (``bind`` in config.yaml), so the
model only sees ``name``."""

from envs import ToolError


def lookup(name: str, directory: list) -> str:
    """Look up a person's phone extension in the office directory.

    Args:
        name: the person's first name, as written in the question.
        directory: the office directory (from the task row, not shown to the model).
    """
    for entry in directory:
        if entry["name"] == name.strip().lower():
            return str(entry["extension"])
    raise ToolError(f"no one named {name!r} in the directory")
