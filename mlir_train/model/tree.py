"""Parameter trees cut into parts and put back together: the one vocabulary for "the trained
part of the weights" (LoRA's adapters) and "the frozen rest" (the base), used by the trainer,
LoRA and the pipeline schedules.

A parameter tree is the model's state as pure nested dicts (``nnx.to_pure_dict``). A part of
it is named in one of two forms:

* a **template**: a nested dict holding the part's keys, its leaves anything (shapes, arrays),
  e.g. ``nnx.to_pure_dict(nnx.state(model, LoRAParam))`` for the adapters. :func:`select`,
  :func:`drop`, :func:`merge` and :func:`contains` follow dict keys alone, so they take trees
  of any leaves the weights are described by: arrays, shapes, partition specs, logical-axis
  tuples (which a ``jax.tree`` walk would open);
* a **mask**: the tree's own structure with a bool per leaf (:func:`mask` of a template).
  :func:`split` cuts an array tree by one into two trees of that structure, each with None in
  the other's places, holding the *same* array objects, not copies: 1F1B keeps the frozen
  weights out of its saved residuals by recognising them by ``id``. :func:`join` undoes a
  split and :func:`prune` drops its holes.
"""

from __future__ import annotations

from typing import Any

import jax


def select(tree: Any, part: Any) -> Any:
    """The part of ``tree`` whose keys are in the template ``part`` (a key ``part`` has and
    ``tree`` lacks is skipped; a leaf of ``part`` takes ``tree``'s whole subtree)."""
    if not isinstance(part, dict):
        return tree
    return {k: select(tree[k], v) for k, v in part.items() if k in tree}


def drop(tree: dict, part: Any) -> dict:
    """``tree`` without the leaves of the template ``part``; dicts it leaves empty are removed."""
    out = {}
    for k, v in tree.items():
        if k not in part:
            out[k] = v
        elif isinstance(v, dict) and isinstance(part[k], dict):
            rest = drop(v, part[k])
            if rest:
                out[k] = rest
    return out


def merge(a: dict, b: dict) -> dict:
    """The union of two trees (e.g. the frozen base and its adapters); where both hold a leaf,
    ``b``'s."""
    out = dict(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if k in out and isinstance(v, dict) else v
    return out


def contains(tree: Any, part: Any) -> bool:
    """Whether ``tree`` holds every leaf of the template ``part``."""
    if not isinstance(part, dict):
        return True
    return isinstance(tree, dict) and all(k in tree and contains(tree[k], v) for k, v in part.items())


def mask(tree: Any, part: Any) -> Any:
    """``tree``'s structure with a bool per leaf: whether the template ``part`` holds it (None:
    every leaf)."""
    if not isinstance(part, dict):
        return jax.tree.map(lambda _: True, tree)
    return {k: mask(v, part[k]) if k in part else jax.tree.map(lambda _: False, v) for k, v in tree.items()}


def split(tree: Any, where: Any) -> tuple[Any, Any]:
    """``tree`` -> (its leaves where the mask ``where`` is True, the others), each the same
    tree with None in the other's places: the same arrays, not copies."""
    return (jax.tree.map(lambda x, m: x if m else None, tree, where),
            jax.tree.map(lambda x, m: None if m else x, tree, where))


def join(kept: Any, rest: Any) -> Any:
    """The inverse of :func:`split`."""
    return jax.tree.map(lambda k, r: r if k is None else k, kept, rest, is_leaf=lambda x: x is None)


def prune(tree: Any) -> Any:
    """``tree`` without its None leaves and the dicts left empty (a :func:`split` half as a
    tree of its own)."""
    if isinstance(tree, dict):
        out = {k: prune(v) for k, v in tree.items()}
        return {k: v for k, v in out.items() if v is not None and not (isinstance(v, dict) and not v)}
    return tree
