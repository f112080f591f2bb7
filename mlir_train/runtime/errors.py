"""Errors the entry points turn into one clear message and exit status 2."""


class CheckpointError(ValueError):
    """A checkpoint or model directory that cannot be read or does not fit this run: missing,
    incomplete, mis-shaped or corrupt tensors, a bad index, another model (names what differs)."""
