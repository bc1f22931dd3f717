"""Composition roots: each worker builds its parts through their constructors, starts them in
order and stops them in reverse. Nothing else wires parts together."""
