"""Training an EAGLE draft head (BRIEF §6): prompts, target features, the training loop."""
