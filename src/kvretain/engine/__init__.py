"""Engines that execute scheduled steps: the simulated engine (``sim``) and, later, a torch engine."""
