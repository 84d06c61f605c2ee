"""Integrations of kvretain's policies into serving engines (each imports its engine lazily)."""
