"""The KV model, the bottom layer: geometry and formula, the engines' rules' base class, model configs, weights, the hub. Imports nothing above it."""
