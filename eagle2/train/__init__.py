"""Training an EAGLE draft head: prompts, target features, the training loop.

See docs/DESIGN.md "Training a head".
"""
