"""Composition roots: the command line, a worker's assembly, graceful drain, `pdserve up`.

Nothing imports this package; it imports whatever it wires together.
"""
