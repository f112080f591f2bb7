"""What a 1F1B backward item is given back of its forward: :class:`Residuals` splits a chunk
forward's ``jax.vjp`` pullback into the residuals that wait in the slot buffer and those the
backward takes again from its own item (weights, layer context)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@dataclasses.dataclass(frozen=True, eq=False)
class Residuals:
    """A chunk forward's ``jax.vjp`` pullback split into what its backward must be given back:
    ``kept``, the residuals that belong to the item (activations, its micro-batch's tensors),
    which wait in the slot buffer, and those that are the chunk's weights or the micro-batch's
    layer context, which the backward takes again from its own item (weights stay where they
    are; the context is rebuilt from the ids) instead of storing a copy per slot."""
    treedef: Any
    sources: tuple  # per pullback leaf: ("kept", i) | ("weight", i) | ("context", i) | ("const", value)
    kept: list

    @classmethod
    def of(cls, pullback, weights, context) -> "Residuals":
        leaves, treedef = jax.tree.flatten(pullback)
        given = {}
        for name, part in (("weight", weights), ("context", context)):
            for i, leaf in enumerate(jax.tree.leaves(part)):
                given.setdefault(id(leaf), (name, i))
        sources, kept, kept_index = [], [], {}
        for leaf in leaves:
            if not isinstance(leaf, jax.Array):  # a constant of the trace (numpy, Python scalar): the same every tick
                sources.append(("const", leaf))
                continue
            if id(leaf) in given:
                sources.append(given[id(leaf)])
                continue
            if id(leaf) not in kept_index:
                kept_index[id(leaf)] = len(kept)
                kept.append(leaf)
            sources.append(("kept", kept_index[id(leaf)]))
        return cls(treedef, tuple(sources), kept)

    def rebuild(self, kept, weights, context):
        """The pullback over ``kept`` (read back from a slot) and the backward item's own
        weights and context."""
        pools = {"kept": kept, "weight": jax.tree.leaves(weights), "context": jax.tree.leaves(context)}
        return jax.tree.unflatten(self.treedef, [i if name == "const" else pools[name][i] for name, i in self.sources])
