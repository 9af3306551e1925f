"""Canonical model input: zones, rendering, tokenization adapters and chained block keys.

Imports nothing from the rest of kvgate.
"""
