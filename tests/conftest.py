"""Shared fixtures: tiny synthetic models, the default model, free ports."""
