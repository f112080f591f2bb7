"""The process: which platform and XLA settings it runs with, its place in a multi-host job,
its console (one logger) and the errors a user can act on."""
