"""The training loop and its components, shared by every recipe (docs/design.md, "Layers")."""
