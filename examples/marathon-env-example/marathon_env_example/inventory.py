"""Inventory: how many of one item are in stock? Tools: ``list_items()`` and ``count(item)``.

Kept small on purpose: it shows the three things a plugin env provides on top of ``envs.ToolEnv``:
tools (JSON-schema arguments, a function returning text), ``_new_task`` drawing the task from
``self.np_random`` (so the seed fixes the task), ``_is_correct``, and an ``oracle_action``.
"""

from __future__ import annotations

from typing import Any

from envs import Tool, ToolEnv, ToolError
from envs.parsing import first_number, format_call

ITEMS = ("apple", "bolt", "candle", "drum", "kettle", "lamp", "rope", "spoon")


class InventoryEnv(ToolEnv):
    def __init__(self, n_items: int = 4, max_turns: int = 4) -> None:
        if not 1 <= n_items <= len(ITEMS):
            raise ValueError(f"n_items must be in 1..{len(ITEMS)}, got {n_items}")
        self.n_items = n_items
        tools = [
            Tool("list_items", "List the items in the warehouse.", {"type": "object", "properties": {}}, self._list),
            Tool(
                "count",
                "How many of one item are in stock.",
                {"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]},
                self._count,
            ),
        ]
        super().__init__(tools, max_turns=max_turns)

    def _new_task(self, options: dict[str, Any] | None) -> list[dict[str, str]]:
        names = self.np_random.choice(ITEMS, size=self.n_items, replace=False)
        self.stock = {str(n): int(self.np_random.integers(0, 50)) for n in names}
        self.target = str(self.np_random.choice(names))
        self.counted = False
        return [
            {"role": "system", "content": "Use the tools, then reply: Final answer: <number>"},
            {"role": "user", "content": f"How many {self.target} items are in stock?"},
        ]

    def _list(self) -> str:
        return ", ".join(sorted(self.stock))

    def _count(self, item: str) -> str:
        if item not in self.stock:
            raise ToolError(f"no item {item!r}; call list_items to see the items")
        self.counted |= item == self.target
        return str(self.stock[item])

    def _is_correct(self, answer: str) -> bool:
        return first_number(answer) == self.stock[self.target]

    def oracle_action(self) -> str:
        if not self.counted:
            return format_call("count", {"item": self.target})
        return f"Final answer: {self.stock[self.target]}"
