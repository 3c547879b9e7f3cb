"""The articles' optimisation table, measured (``python -m kvbench.selfcheck.optimisation_table``).

``columns`` declares the table's columns (each a class that owns its settings and registers itself, in the
articles' order) and the engine configurations each runs; ``trials`` runs one configuration inside a memory
wall and records what came of it; ``table`` assembles the table from the trials' records (pure), with the
planner's answer beside each measured cell and the articles' own scenario planned; ``plot`` draws it.
"""
