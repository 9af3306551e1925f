"""Discrete-event simulator: real routing policies against the engine model, in virtual time."""
