"""Checkpoint reading and weight loading."""
