"""Plumbing a fork copies but rarely edits: the command line and config, the run folder, distribution over processes,
model loading, the optimiser step, batches and their forwards, and metrics. Nothing here imports a stage."""
