"""Measuring commands that start workers: ``paratrain bench comm`` (collectives over message sizes)."""
