"""Model building blocks (layers) and the built-in models."""
