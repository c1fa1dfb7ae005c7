"""Framework integrations: ``integrations.flax`` (JAX/Flax) and, later, ``integrations.torch_xla``.

Each subpackage imports its framework lazily: importing one never imports the other.
"""
