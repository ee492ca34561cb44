"""Local training: model, data, inner and outer optimizers, checkpoints. Knows nothing of the network."""
