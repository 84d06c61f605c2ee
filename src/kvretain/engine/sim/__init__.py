"""Serving simulator: virtual-time engine, cost models and hardware/model catalogs (torch-free)."""
