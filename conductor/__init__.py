"""The conductor: finds attention and recurrent-scan blocks in a traced step and
rewrites them into Pallas kernels (issue 6). Nothing is implemented yet."""

__all__: list[str] = []
