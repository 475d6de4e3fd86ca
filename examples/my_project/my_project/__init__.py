"""A small classifier project: the model, its data and its training step."""
