"""A persistent batch driven the way vLLM's InputBatch drives it: each step some requests finish,
new ones take the lowest freed rows, the batch is condensed (the last request moves into the lowest
hole) and some rows are swapped. Works with logitgate's and with vLLM's BatchUpdateBuilder."""
from __future__ import annotations

import random
from collections.abc import Callable


class PersistentBatch:
    """`slots[i]` is the request at row i: a dict with at least "params", "prompt" and "output"
    (the output list is handed to the processors by reference and appended to by the test)."""

    def __init__(self, rng: random.Random, new_request: Callable[[random.Random], dict], builder, directions, max_requests: int = 8):
        self.rng = rng
        self.new_request = new_request
        self.builder = builder
        self.directions = directions  # a MoveDirectionality enum (logitgate's or vLLM's)
        self.max_requests = max_requests
        self.slots: list[dict | None] = []
        self.next_id = 0

    @property
    def size(self) -> int:
        return len(self.slots)

    def step_changes(self):
        rng = self.rng
        for index, slot in enumerate(self.slots):
            if slot is not None and rng.random() < 0.15:
                self.slots[index] = None
                self.builder.removed_append(index)
        for _ in range(rng.randint(0, 3)):
            if sum(s is not None for s in self.slots) >= self.max_requests:
                break
            request = {"id": self.next_id, **self.new_request(rng)}
            self.next_id += 1
            index = self.builder.pop_removed()
            if index is None:
                index = len(self.slots)
                self.slots.append(None)
            self.slots[index] = request
            self._add(index, request)
        # Condense: move the last request into the lowest hole until the batch is dense.
        holes = sorted(self.builder.removed)
        while holes:
            hole = holes.pop(0)
            while self.slots and self.slots[-1] is None:
                self.slots.pop()
            if hole >= len(self.slots):
                continue
            last = len(self.slots) - 1
            self.slots[hole], self.slots[last] = self.slots[last], None
            self._move(last, hole, self.directions.UNIDIRECTIONAL)
            self.slots.pop()
        while self.slots and self.slots[-1] is None:
            self.slots.pop()
        for _ in range(rng.randint(0, 2)):
            if len(self.slots) >= 2:
                a, b = rng.sample(range(len(self.slots)), 2)
                self.slots[a], self.slots[b] = self.slots[b], self.slots[a]
                self._move(a, b, self.directions.SWAP)
        assert all(s is not None for s in self.slots)
        return self.builder.get_and_reset(len(self.slots))

    # logitgate's builder has checked add/move methods; vLLM's InputBatch appends to the lists.
    def _add(self, index: int, request: dict) -> None:
        entry = (index, request["params"], request["prompt"], request["output"])
        if hasattr(self.builder, "add"):
            self.builder.add(*entry)
        else:
            self.builder.added.append(entry)

    def _move(self, a: int, b: int, direction) -> None:
        if hasattr(self.builder, "move"):
            self.builder.move(a, b, direction)
        else:
            self.builder.moved.append((a, b, direction))
