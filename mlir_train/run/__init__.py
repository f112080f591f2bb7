"""The whole run: :mod:`.job` builds what a configuration describes, :mod:`.loop` runs it."""
