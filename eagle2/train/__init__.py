"""Training an EAGLE draft head: prompts, target features, the training loop.

See docs/training.md "Training a head".
"""
